"""Stream batching that never delays the first token.

Ray Serve LLM batches a streamed response on the LLM replica (``Batcher``): every ``interval_ms`` it forwards
what the engine produced since the last tick, so each chunk is one Ray streaming message through the ingress
replica and the proxy instead of one per engine step. Its ``stream()`` waits out a whole interval before the
first forward, so the first token of every request waits for the next tick (up to ``interval_ms``, half of it
on average) whatever the engine does. ``FirstChunkNowBatcher`` forwards the first result as soon as it exists
and batches the rest as Ray does (the fix proposed upstream in ray-project/ray pull request 64534).
"""

from __future__ import annotations

import asyncio
from typing import AsyncGenerator, Iterable, TypeVar

from ray.llm._internal.serve.utils.batcher import Batcher

T = TypeVar("T")


class FirstChunkNowBatcher(Batcher[T]):
    """``Batcher`` whose first batch leaves as soon as the generator yields once; later ones every interval.
    Interval 0 (no batching) and ``None`` (one batch at the end, for non-streamed responses) are Ray's."""

    def __init__(self, generator: AsyncGenerator[T, None], interval_ms: float | None) -> None:
        self.first_event = asyncio.Event()
        super().__init__(generator, interval_ms=interval_ms)

    async def read(self) -> None:
        try:
            async for item in self.generator:
                self.queue.put_nowait(item)
                self.first_event.set()
        finally:
            self.first_event.set()
            self.done_event.set()

    async def stream(self) -> AsyncGenerator[Iterable[T], None]:
        if not self.interval_s:  # 0 or None: nothing to wait for early
            async for batch in super().stream():
                yield batch
            return
        try:
            await self.first_event.wait()
            results, is_done = self.check_done_and_drain()
            if results:
                yield self._merge_results(results)
            if is_done:
                self.read_task.result()  # raise what the engine raised
                return
            async for batch in super().stream():
                yield batch
        finally:
            if not self.read_task.done():  # closed early (client gone): stop reading the engine too
                self.read_task.cancel()
