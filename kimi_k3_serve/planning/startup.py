"""Start-up budgets from a load-time estimate: how long a replica may take to start before it is called stuck.

A replica of Kimi-K3 starts in three steps, each bounded by something that kills it when the bound is too short:

1. every node gets its checkpoint files (downloaded as the replica starts, or beforehand by ``prefetch``) and vLLM
   reads every file in its folder from disk; the nodes of a replica do this in parallel;
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

The estimate is ``planning.checkpoint.NodeLoad``, the same one ``check`` prints per node: the node's bytes
(``CheckpointPlan.node_bytes``: its stages' files when ``args.model.download_dir`` holds a prefetched copy, else the
whole checkpoint, which Ray Serve LLM downloads on every node), downloaded at the slower of the node's network and
disk, then read at the disk's read bandwidth (not overlapped: the conservative order vLLM and Ray Serve LLM follow);
a prefetched copy is only read (``prefetch`` downloaded it before the deploy). The bandwidths are the node type's
(``hardware.NODE_IO``, the cluster file's volume through ``hardware.ebs_volume_read``), or
``hardware.DEFAULT_NODE_IO`` where the node type is not known, and the lines say which. The slowest node binds;
then the engine start. Margins (stated, not fitted): ``LOAD_MARGIN`` x the load (declared bandwidths are peaks; a
shared disk, a throttled bucket or a hub mirror runs slower), ``ENGINE_START_MARGIN`` x the engine start (measured
on one H200 rank; TP8 x PP2 adds NCCL set-up across nodes and the Ray workers' start).

Pure: per-node load estimates in, budgets out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.checkpoint import NodeLoad
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
class StartupBudgets:
    """The estimate and the budgets derived from it; every time in seconds."""

    nodes: tuple[NodeLoad, ...]
    engine_start_s: float
    load_margin: float
    engine_start_margin: float
    engine_start_timeout_s: int
    """``RAYLLM_ENGINE_START_TIMEOUT_S``: margin x (slowest node's load) + margin x engine start, in whole minutes."""
    liveness_failure_threshold: int
    """Failures of KubeRay's raylet liveness check (every ``KUBERAY_LIVENESS_PERIOD_S``) before the pod restarts:
    at least KubeRay's own 120, and enough to outlast the slowest node's load with its margin."""
    node_type: str | None = None
    """The node type the estimate is for (``p5en.48xlarge``, a KubeRay pod), when one is known."""

    @property
    def slowest(self) -> NodeLoad:
        return max(self.nodes, key=lambda n: n.start_s)

    @property
    def load_s(self) -> float:
        """What the slowest node's start waits for: its download (unless prefetched) and its read."""
        return self.slowest.start_s

    @property
    def estimate_s(self) -> float:
        """The point estimate, no margin: slowest node's load, then the engine start."""
        return self.load_s + self.engine_start_s

    @property
    def liveness_window_s(self) -> int:
        return self.liveness_failure_threshold * KUBERAY_LIVENESS_PERIOD_S

    def deploy_comment(self, why: str = "") -> tuple[str, ...]:
        """The comment a deploy config carries above its ``RAYLLM_ENGINE_START_TIMEOUT_S`` (a test checks it).
        ``why``: a third line, which node type binds and why that one."""
        return (f"Start-up budget: {self.load_margin:g} x {self.load_s:,.0f} s loading the slowest node's checkpoint + "
                f"{self.engine_start_margin:g} x {self.engine_start_s:,.0f} s engine start (measured), in",
                "whole minutes (planning/startup.py; `kimi-k3-serve render` prints the derivation, a test recomputes it).",
                *((why,) if why else ()))

    def lines(self) -> tuple[str, ...]:
        """The derivation, for a file's header or a console; every size and time with its unit."""
        slow = self.slowest
        bw = slow.bandwidth
        if slow.prefetched:
            load = (f"reads its {slow.nbytes / GB:,.1f} GB prefetched copy (args.model.download_dir; `prefetch` "
                    f"downloaded it before the deploy) at {bw.disk_read_bytes_per_s / GB:,.2f} GB/s ({slow.read_s:,.0f} s);")
        else:
            load = (f"downloads {slow.nbytes / GB:,.1f} GB (the whole checkpoint: no args.model.download_dir) at "
                    f"{bw.download_bytes_per_s / GB:,.2f} GB/s ({slow.download_s:,.0f} s) and reads it at "
                    f"{bw.disk_read_bytes_per_s / GB:,.2f} GB/s ({slow.read_s:,.0f} s);")
        out = [f"Start-up budget (kimi_k3_serve.planning.startup): the slowest node ({slow.node}) {load}",
               f"  bandwidths: {bw.source}."]
        if bw.defaulted:
            from kimi_k3_serve.planning.hardware import DEFAULT_NODE_IO

            out.append(f"  The default (hardware.DEFAULT_NODE_IO), where the node type or its volume is not known: "
                       f"{DEFAULT_NODE_IO.source}.")
        out += [
            f"  Then vLLM's engine start, {self.engine_start_s:,.0f} s measured ({ENGINE_START_RUN}): "
            f"estimate {self.estimate_s:,.0f} s.",
            f"  RAYLLM_ENGINE_START_TIMEOUT_S = {self.load_margin:g} x {self.load_s:,.0f} s + "
            f"{self.engine_start_margin:g} x {self.engine_start_s:,.0f} s, rounded up to a minute = "
            f"{self.engine_start_timeout_s} s.",
            f"  KubeRay worker liveness: {self.liveness_failure_threshold} failures x {KUBERAY_LIVENESS_PERIOD_S} s = "
            f"{self.liveness_window_s} s >= {self.load_margin:g} x the node's load; readiness gates traffic only (KubeRay's own).",
        ]
        return tuple(out)

    def to_json(self) -> dict:
        return {"node_type": self.node_type, "slowest_node": self.slowest.node, "load_s": self.load_s,
                "engine_start_s": self.engine_start_s, "estimate_s": self.estimate_s, "load_margin": self.load_margin,
                "engine_start_margin": self.engine_start_margin, "engine_start_timeout_s": self.engine_start_timeout_s,
                "liveness_failure_threshold": self.liveness_failure_threshold,
                "liveness_window_s": self.liveness_window_s,
                "nodes": [{"node": n.node, "bytes": n.nbytes, **n.to_json()} for n in self.nodes]}


def _round_up(seconds: float, step: int) -> int:
    return int(math.ceil(round(seconds, 6) / step) * step)


def startup_budgets(
    *,
    nodes: Sequence[NodeLoad] | Iterable[NodeLoad],
    engine_start_s: float = ENGINE_START_S,
    load_margin: float = LOAD_MARGIN,
    engine_start_margin: float = ENGINE_START_MARGIN,
    node_type: str | None = None,
) -> StartupBudgets:
    """The budgets for a replica whose nodes load as ``nodes`` estimate (``planning.checkpoint.node_load``)."""
    loads = tuple(nodes)
    if not loads:
        raise ConfigError("nodes", [], "expected at least one node of the replica")
    if not isinstance(engine_start_s, (int, float)) or isinstance(engine_start_s, bool) or not engine_start_s >= 0:
        raise ConfigError("engine_start_s", engine_start_s, "expected seconds >= 0")
    for name, margin in (("load_margin", load_margin), ("engine_start_margin", engine_start_margin)):
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) or not 1 <= margin <= 10:
            raise ConfigError(name, margin, "expected a factor from 1 to 10")
    load_s = max(n.start_s for n in loads)
    timeout = _round_up(load_margin * load_s + engine_start_margin * engine_start_s, BUDGET_ROUNDING_S)
    liveness = max(KUBERAY_LIVENESS_FAILURE_THRESHOLD, math.ceil(round(load_margin * load_s, 6) / KUBERAY_LIVENESS_PERIOD_S))
    return StartupBudgets(
        nodes=loads,
        engine_start_s=float(engine_start_s),
        load_margin=float(load_margin),
        engine_start_margin=float(engine_start_margin),
        engine_start_timeout_s=timeout,
        liveness_failure_threshold=liveness,
        node_type=node_type,
    )
