"""``FirstChunkNowBatcher``: the first result leaves at once, later ones are batched per interval as Ray does.

The engine stream is an async generator driven by events, so what is asserted does not depend on how fast
this machine is: a first batch that waited for the interval (10 s here) would miss the 5 s deadline.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.llm._internal.serve.utils.batcher import Batcher

from kimi_k3_serve.serving.server import LLMServer
from kimi_k3_serve.serving.streaming import FirstChunkNowBatcher

LONG_INTERVAL_MS = 10_000
DEADLINE_S = 5.0


class EngineStream:
    """Yields 1, waits until the consumer has the first batch, then yields ``rest`` back to back."""

    def __init__(self, rest=(2, 3, 4), fail_after_first: bool = False):
        self.first_taken = asyncio.Event()
        self.rest = rest
        self.fail_after_first = fail_after_first
        self.closed = False

    async def __call__(self):
        try:
            yield 1
            await self.first_taken.wait()
            if self.fail_after_first:
                raise RuntimeError("engine failed")
            for item in self.rest:
                yield item
        finally:
            self.closed = True


async def _first_batch(batcher_cls, interval_ms):
    engine = EngineStream()
    stream = batcher_cls(engine(), interval_ms=interval_ms).stream()
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout=DEADLINE_S)
    finally:
        await stream.aclose()


def test_first_result_is_not_held_for_the_interval():
    assert asyncio.run(_first_batch(FirstChunkNowBatcher, LONG_INTERVAL_MS)) == [1]


def test_rays_batcher_holds_the_first_result_for_the_interval():
    """What the subclass fixes (ray-project/ray issue 59681): the same stream misses the deadline under Ray's."""
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(_first_batch(Batcher, LONG_INTERVAL_MS))


async def _all_batches(interval_ms, **engine_options):
    engine = EngineStream(**engine_options)
    batches = []
    async for batch in FirstChunkNowBatcher(engine(), interval_ms=interval_ms).stream():
        batches.append(list(batch))
        engine.first_taken.set()
    return batches, engine


def test_results_after_the_first_are_batched():
    batches, engine = asyncio.run(_all_batches(50))
    assert batches == [[1], [2, 3, 4]]
    assert engine.closed


def test_no_interval_forwards_every_result_alone():
    batches, _ = asyncio.run(_all_batches(0))
    assert batches == [[1], [2], [3], [4]]


def test_an_engine_error_reaches_the_caller():
    async def run():
        engine = EngineStream(fail_after_first=True)
        batches = []
        with pytest.raises(RuntimeError, match="engine failed"):
            async for batch in FirstChunkNowBatcher(engine(), interval_ms=50).stream():
                batches.append(list(batch))
                engine.first_taken.set()
        return batches

    assert asyncio.run(run()) == [[1]]


def test_an_empty_stream_ends_without_batches():
    async def nothing():
        return
        yield  # an async generator that yields nothing

    async def run():
        return [batch async for batch in FirstChunkNowBatcher(nothing(), interval_ms=50).stream()]

    assert asyncio.run(run()) == []


def test_closing_the_stream_early_stops_reading_the_engine():
    """A client that disconnects after the first token: the engine stream is closed, not drained."""
    async def run():
        engine = EngineStream()
        batcher = FirstChunkNowBatcher(engine(), interval_ms=50)
        stream = batcher.stream()
        assert await stream.__anext__() == [1]
        await stream.aclose()
        await asyncio.sleep(0)  # let the cancelled reader unwind
        return engine, batcher

    engine, batcher = asyncio.run(run())
    assert batcher.read_task.cancelled() or batcher.read_task.done()
    assert engine.closed


def test_the_llm_server_streams_through_it():
    server = SimpleNamespace(_get_batch_interval_ms=lambda: LONG_INTERVAL_MS)

    async def run():
        engine = EngineStream()
        stream = LLMServer._batch_output_stream(server, engine())
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout=DEADLINE_S)
        finally:
            await stream.aclose()

    assert asyncio.run(run()) == [1]


# --- the default: every engine output sent alone (token by token), through Ray Serve LLM's own LLMServer -----------

TOKENS = 20


def _dev_llm_server(**deployment):
    """Our LLM replica class on the dev config's ``experimental_configs`` (``kimi_k3_serve.app``), unstarted."""
    from ray.serve.llm import LLMConfig

    from kimi_k3_serve.app import experimental_configs
    from kimi_k3_serve.config.args import load_args
    from kimi_k3_serve.config.serve_config import load_serve_app

    from conftest import REPO_ROOT

    raw = load_serve_app(REPO_ROOT / "deploy" / "dev.yaml").raw_args
    raw = {**raw, "deployment": {**(raw.get("deployment") or {}), **deployment}}
    config = LLMConfig(model_loading_config={"model_id": "tiny-llama", "model_source": "tiny-llama"},
                       experimental_configs=experimental_configs(load_args(raw, source="test")))
    return LLMServer.sync_init(config)


async def _engine_tokens():
    """The engine's stream: one output per step, back to back (the consumer only ever waits on the batcher)."""
    for token in range(TOKENS):
        yield f"data: token {token}\n\n"
        await asyncio.sleep(0)


def _chunks(server) -> list[list[str]]:
    async def run():
        return [list(batch) async for batch in server._batch_output_stream(_engine_tokens())]

    return asyncio.run(run())


def test_a_stream_delivers_one_chunk_per_token_by_default():
    """The dev app's LLM replica, as built (no batching interval set in deploy/dev.yaml): every engine output is
    one message to the ingress, so the client reads one SSE chunk per token, as from bare vLLM."""
    server = _dev_llm_server()
    assert server._get_batch_interval_ms() == 0
    chunks = _chunks(server)
    assert chunks == [[f"data: token {i}\n\n"] for i in range(TOKENS)]


def test_batching_is_an_option_and_still_sends_the_first_token_at_once():
    """``args.deployment.stream_batching_interval_ms: 50``: the first output alone, the rest merged (bursts)."""
    server = _dev_llm_server(stream_batching_interval_ms=50)
    chunks = _chunks(server)
    assert chunks[0] == ["data: token 0\n\n"]
    assert len(chunks) < TOKENS and sum(map(len, chunks)) == TOKENS
