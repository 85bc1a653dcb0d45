"""Start-up budgets from a load-time estimate: how long a replica may take to start before it is called stuck.

A replica of Kimi-K3 starts in three steps, each bounded by something that kills it when the bound is too short:

1. every node gets its checkpoint files (download at the node's network bandwidth) and vLLM reads its stage's
   tensors from disk (at the node's disk-read bandwidth); the nodes of a replica do this in parallel;
2. vLLM builds the engine: process start, weights post-processing, memory profile, KV cache, CUDA graphs, kernel
   JIT and warmup (``ENGINE_START_S``, measured);
3. Serve marks the replica running once the constructor returns.

What bounds each step (read in the installed Ray 2.60 and KubeRay >= 1.5 sources):

- **Ray Serve LLM's engine start timeout** ``RAYLLM_ENGINE_START_TIMEOUT_S`` (default 3600 s,
  ``ray/llm/_internal/serve/constants.py``): ``LLMServer.start`` wraps the whole engine start, download and load
  included, in ``asyncio.wait_for``. It is read once, at import, in the replica process, so it goes into the
  deployment's ``runtime_env``. This is the budget of steps 1 and 2 together.
- **Serve's health check** does not run while the constructor runs: a replica is health-checked only once it is
  running (``deployment_state.py``: ``check_ready`` then ``check_health``), so ``health_check_period_s`` and
  ``health_check_timeout_s`` need no load-time grace; the start-up timeout above is that grace. A failed start is
  retried (``max_constructor_retry_count``, 20; at most 3 per replica), each retry a full load again.
- **KubeRay's liveness probe** of a worker pod checks its raylet (``api/local_raylet_healthz`` on the dashboard agent
  port 52365). KubeRay's own (injected only where the pod sets none) gives up after 120 failures 5 s apart: 600 s.
  A node reading and writing hundreds of GB can starve its raylet for a while; the pod's restart would restart the
  whole replica's load. :func:`startup_budgets` widens that window to the node's load estimate (with margin).
- **KubeRay's readiness probe** of a RayService worker (raylet plus the Serve proxy's ``/-/healthz``) gates
  traffic only: a pod that is not ready yet is left out of the Serve service and restarted by nothing. It is left
  to KubeRay (a load-time grace there would only hold back traffic from a replica that is already up).

The estimate: per node, ``download_bytes / network_bytes_per_s + read_bytes / disk_read_bytes_per_s`` (download then
read, not overlapped: the conservative order vLLM and Ray Serve LLM follow), the slowest node binding; then the
engine start. Margins (stated, not fitted): ``LOAD_MARGIN`` x the load (declared bandwidths are peaks; a shared
disk, a throttled bucket or a hub mirror runs slower), ``ENGINE_START_MARGIN`` x the engine start (measured on one
H200 rank; TP8 x PP2 adds NCCL set-up across nodes and the Ray workers' start).

Pure: bytes and bandwidths in, budgets out. The bytes per node and the bandwidths are arguments: the bytes come from
the planner's stage split (or the checkpoint index, issue 25 part 1), the bandwidths from the node type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.units import GB

ENGINE_START_S = 360.0
"""Seconds one full-depth Kimi-K3 rank takes to start vLLM's engine on a cold H200 host, weights aside: run
``r44-s1-dspark`` of 2026-12-01 (``tests/fixtures/gpu/2026-12-01/r44-s1-dspark/job.json`` ``seconds``: the whole
``rehearse`` process, stage 1's 44 layers at one TP8 rank's shapes plus DSpark, dummy weights). It is the slowest of
the four full-depth rank runs of that session (r49-s0 96 s, r44-s1-dspark-u095 160 s, r44-s1-eagle3-mla 140 s) because
it was the host's first start: vLLM's log there says "init engine (profile, create kv cache, warmup model) took
196.62 s" (FlashInfer and CuTe DSL kernels built cold) and "Model loading took 97.16 GiB memory and 21.597665 seconds"
(dummy weights: allocation and the Marlin repack, no disk). A new node of a scale-out is cold too.
``tests/test_startup.py`` reads the logs again."""
ENGINE_START_RUN = "tests/fixtures/gpu/2026-12-01/r44-s1-dspark"
LOAD_MARGIN = 2.0
"""The load may take twice what the declared bandwidths give before the replica is called stuck."""
ENGINE_START_MARGIN = 1.5
"""The engine start may take 1.5 x the measured single-rank start (cross-node NCCL set-up, Ray workers)."""
BUDGET_ROUNDING_S = 60
"""Budgets are rounded up to whole minutes."""

KUBERAY_LIVENESS_PERIOD_S = 5
KUBERAY_LIVENESS_TIMEOUT_S = 2
KUBERAY_LIVENESS_INITIAL_DELAY_S = 30
KUBERAY_LIVENESS_FAILURE_THRESHOLD = 120
"""KubeRay's injected worker liveness probe (``ray-operator/controllers/ray/utils/constant.go``): 30 s initial delay,
every 5 s, 2 s timeout, 120 failures (600 s). The rendered probe keeps all but the failure count."""


@dataclass(frozen=True)
class NodeLoad:
    """What one node of a replica must fetch and read before its vLLM workers hold their weights."""

    node: str
    """A name for people: ``stage 0``, a Ray node id, a pod."""
    download_bytes: int
    """Bytes the node downloads (0 when its files are already on its disk)."""
    read_bytes: int
    """Bytes vLLM reads from the node's disk into its GPUs."""

    def __post_init__(self) -> None:
        for name in ("download_bytes", "read_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"node_load.{name}", value, "expected an integer >= 0 bytes")


@dataclass(frozen=True)
class NodeEstimate:
    node: str
    download_bytes: int
    read_bytes: int
    download_s: float
    read_s: float

    @property
    def load_s(self) -> float:
        return self.download_s + self.read_s


@dataclass(frozen=True)
class StartupBudgets:
    """The estimate and the budgets derived from it; every time in seconds."""

    nodes: tuple[NodeEstimate, ...]
    network_bytes_per_s: int
    disk_read_bytes_per_s: int
    engine_start_s: float
    load_margin: float
    engine_start_margin: float
    engine_start_timeout_s: int
    """``RAYLLM_ENGINE_START_TIMEOUT_S``: margin x (slowest node's load) + margin x engine start, in whole minutes."""
    liveness_failure_threshold: int
    """Failures of KubeRay's raylet liveness check (every ``KUBERAY_LIVENESS_PERIOD_S``) before the pod restarts:
    at least KubeRay's own 120, and enough to outlast the slowest node's load with its margin."""

    @property
    def slowest(self) -> NodeEstimate:
        return max(self.nodes, key=lambda n: n.load_s)

    @property
    def load_s(self) -> float:
        return self.slowest.load_s

    @property
    def estimate_s(self) -> float:
        """The point estimate, no margin: slowest node's load, then the engine start."""
        return self.load_s + self.engine_start_s

    @property
    def liveness_window_s(self) -> int:
        return self.liveness_failure_threshold * KUBERAY_LIVENESS_PERIOD_S

    def deploy_comment(self) -> tuple[str, str]:
        """The comment a deploy config carries above its ``RAYLLM_ENGINE_START_TIMEOUT_S`` (a test checks both)."""
        return (f"Start-up budget: {self.load_margin:g} x {self.load_s:,.0f} s loading the slowest node's checkpoint + "
                f"{self.engine_start_margin:g} x {self.engine_start_s:,.0f} s engine start (measured), in",
                "whole minutes (planning/startup.py; `kimi-k3-serve render` prints the derivation, a test recomputes it).")

    def lines(self) -> tuple[str, ...]:
        """The derivation, for a file's header or a console; every size and time with its unit."""
        slow = self.slowest
        return (
            f"Start-up budget (kimi_k3_serve.planning.startup): the slowest node ({slow.node}) downloads "
            f"{slow.download_bytes / GB:,.1f} GB at {self.network_bytes_per_s / GB:,.2f} GB/s ({slow.download_s:,.0f} s) "
            f"and reads {slow.read_bytes / GB:,.1f} GB at {self.disk_read_bytes_per_s / GB:,.2f} GB/s ({slow.read_s:,.0f} s);",
            f"  then vLLM's engine start, {self.engine_start_s:,.0f} s measured ({ENGINE_START_RUN}): "
            f"estimate {self.estimate_s:,.0f} s.",
            f"  RAYLLM_ENGINE_START_TIMEOUT_S = {self.load_margin:g} x {self.load_s:,.0f} s + "
            f"{self.engine_start_margin:g} x {self.engine_start_s:,.0f} s, rounded up to a minute = "
            f"{self.engine_start_timeout_s} s.",
            f"  KubeRay worker liveness: {self.liveness_failure_threshold} failures x {KUBERAY_LIVENESS_PERIOD_S} s = "
            f"{self.liveness_window_s} s >= {self.load_margin:g} x the node's load; readiness gates traffic only (KubeRay's own).",
        )


def _positive_int(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, value, "expected an integer > 0 bytes per second")
    return value


def _round_up(seconds: float, step: int) -> int:
    return int(math.ceil(round(seconds, 6) / step) * step)


def startup_budgets(
    *,
    nodes: Sequence[NodeLoad] | Iterable[NodeLoad],
    network_bytes_per_s: int,
    disk_read_bytes_per_s: int,
    engine_start_s: float = ENGINE_START_S,
    load_margin: float = LOAD_MARGIN,
    engine_start_margin: float = ENGINE_START_MARGIN,
) -> StartupBudgets:
    """The budgets for a replica whose nodes load ``nodes`` at the given bandwidths (bytes per second)."""
    loads = tuple(nodes)
    if not loads:
        raise ConfigError("nodes", [], "expected at least one node of the replica")
    network = _positive_int("network_bytes_per_s", network_bytes_per_s)
    disk = _positive_int("disk_read_bytes_per_s", disk_read_bytes_per_s)
    if not isinstance(engine_start_s, (int, float)) or isinstance(engine_start_s, bool) or not engine_start_s >= 0:
        raise ConfigError("engine_start_s", engine_start_s, "expected seconds >= 0")
    for name, margin in (("load_margin", load_margin), ("engine_start_margin", engine_start_margin)):
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 1 <= margin <= 10:
            raise ConfigError(name, margin, "expected a factor from 1 to 10")
    estimates = tuple(
        NodeEstimate(n.node, n.download_bytes, n.read_bytes, n.download_bytes / network, n.read_bytes / disk) for n in loads
    )
    load_s = max(e.load_s for e in estimates)
    timeout = _round_up(load_margin * load_s + engine_start_margin * engine_start_s, BUDGET_ROUNDING_S)
    liveness = max(KUBERAY_LIVENESS_FAILURE_THRESHOLD, math.ceil(round(load_margin * load_s, 6) / KUBERAY_LIVENESS_PERIOD_S))
    return StartupBudgets(
        nodes=estimates,
        network_bytes_per_s=network,
        disk_read_bytes_per_s=disk,
        engine_start_s=float(engine_start_s),
        load_margin=float(load_margin),
        engine_start_margin=float(engine_start_margin),
        engine_start_timeout_s=timeout,
        liveness_failure_threshold=liveness,
    )


# ----------------------------------------------------------------------------------------------------------------
# Which bytes a node needs, as the planner splits the model
# ----------------------------------------------------------------------------------------------------------------


def stage_checkpoint_bytes(model, stage_layers: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Checkpoint bytes of each pipeline stage's tensors, as vLLM 0.32 splits them: the embedding on the first
    stage, the layers in each stage's range, the final norm and lm_head (``head``) and the draft's own tensors on
    the last. The vision tower is left out (the deploy configs serve text only)."""
    last = len(stage_layers) - 1
    out = []
    for stage, (start, end) in enumerate(stage_layers):
        total = sum(t.checkpoint_bytes for layer in model.layers[start:end] for t in layer.tensors)
        if stage == 0:
            total += sum(t.checkpoint_bytes for t in model.embedding)
        if stage == last:
            total += sum(t.checkpoint_bytes for t in (*model.head, *model.draft_extra))
        out.append(total)
    return tuple(out)


# ----------------------------------------------------------------------------------------------------------------
# Interim node bandwidths
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeBandwidth:
    network_bytes_per_s: int
    disk_read_bytes_per_s: int
    source: str


INTERIM_BANDWIDTH = NodeBandwidth(
    network_bytes_per_s=1_250_000_000,
    disk_read_bytes_per_s=2 * GB,
    source="interim, every node type alike: 10 Gbit/s (1.25 GB/s) sustained download from the hub or a bucket per "
    "node, 2 GB/s sequential read of one local NVMe SSD; TODO(#25): the hardware catalogue's declared "
    "network_bytes_per_s / disk_read_bytes_per_s of the node type (issue 25 part 1)",
)
"""What the cluster files' budgets use until the catalogue declares each node type's bandwidths."""
