"""Fit the Kimi-K3 CUDA-graph constants of kimi_k3_serve.planning.memory on the fit runs alone, and score them.

vLLM's CUDA-graph estimate (``profile_cudagraph_memory``) is modelled as the first capture's activations plus, per
captured graph, ``per_graph + per_layer x local layers`` for the target and, on the last stage,
``draft_per_graph + draft_per_head x the draft's heads on the rank`` for DSpark. The plan is linear in these four
constants, so they are fitted by least squares on the runs ``CUDA_GRAPH_FIT_RUNS`` names (their role, ``fit``, was
fixed in scripts/gpu/matrix.py before they ran). Printed: the constants, each fit run's residual, leave-one-out over
the fit runs (each constant refitted without that run, the run predicted), and the error on every validation run.

    python scripts/fit_cuda_graphs.py            # prints the fit; --write puts the constants into memory.py
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import itertools

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import memory_accuracy  # noqa: E402
from kimi_k3_serve.planning import memory  # noqa: E402
from kimi_k3_serve.units import GiB, MiB  # noqa: E402

CONSTANTS = (("CUDA_GRAPH_PER_GRAPH", "kimi_k3"), ("CUDA_GRAPH_PER_LAYER", "kimi_k3"), ("CUDA_GRAPH_PER_HEAD", "kimi_k3"),
             ("CUDA_GRAPH_DRAFT_PER_GRAPH", "dspark"), ("CUDA_GRAPH_DRAFT_PER_HEAD", "dspark"))
"""The four fitted constants: (module dict, key)."""


@dataclass(frozen=True)
class Row:
    name: str
    role: str
    measured: int
    planned_at_zero: int
    """The plan's estimate with the four constants at 0 (the first capture's activations)."""
    per_constant: tuple[int, ...]
    """What 1 byte of each constant adds to the plan's estimate (graphs x its multiplier)."""

    def predict(self, theta: np.ndarray) -> float:
        return self.planned_at_zero + float(np.dot(self.per_constant, theta))


@contextlib.contextmanager
def constants(values: tuple[float, ...]):
    saved = [getattr(memory, d)[k] if k in getattr(memory, d) else None for d, k in CONSTANTS]
    for (d, k), v in zip(CONSTANTS, values):
        getattr(memory, d)[k] = int(v)
    try:
        yield
    finally:
        for (d, k), v in zip(CONSTANTS, saved):
            getattr(memory, d)[k] = v


def _kimi_runs() -> list[Path]:
    return [d for d in sorted(memory_accuracy.FIXTURES.glob("*/*")) if (d / "vllm.log").is_file()
            and d.name != "k8-tp1-b2048-s256-eagle3" and not d.name.startswith(("llama", "qwen", "deepseek"))]


def _estimates(run_dirs: list[Path], values: tuple[float, ...]) -> dict[str, tuple[str, int, int | None]]:
    """Rank 0 of every run: (role, the plan's CUDA-graph estimate, vLLM's) at these constants."""
    out = {}
    with constants(values):
        for d in run_dirs:
            rows = memory_accuracy.accuracy(d)
            if rows and rows[0].cuda_graph[1]:
                role = "fit" if d.name in memory.CUDA_GRAPH_FIT_RUNS else rows[0].role
                out[d.name] = (role, rows[0].cuda_graph[0], rows[0].cuda_graph[1])
    return out


def design(run_dirs: list[Path] | None = None) -> list[Row]:
    """Each run as a row of the linear model (the plan probed at 0 and at 1 MiB of each constant)."""
    run_dirs = run_dirs if run_dirs is not None else _kimi_runs()
    zero = _estimates(run_dirs, (0,) * len(CONSTANTS))
    unit = [_estimates(run_dirs, tuple(MiB if i == j else 0 for j in range(len(CONSTANTS)))) for i in range(len(CONSTANTS))]
    return [Row(name, role, measured, at_zero, tuple((u[name][1] - at_zero) / MiB for u in unit))
            for name, (role, at_zero, measured) in zero.items()]


def fit(rows: list[Row]) -> np.ndarray:
    a = np.array([r.per_constant for r in rows], dtype=float)
    b = np.array([r.measured - r.planned_at_zero for r in rows], dtype=float)
    # Relative errors weigh alike (a 0.2 GiB rank slice and a 3.5 GiB full-width slice), and no constant is negative
    # (a graph costs no negative memory): non-negative least squares on the rows scaled by 1 / vLLM's estimate.
    scale = 1 / np.array([r.measured for r in rows], dtype=float)
    a, b = a * scale[:, None], b * scale
    best, best_cost = np.zeros(a.shape[1]), float(np.sum(b ** 2))
    for k in range(1, a.shape[1] + 1):  # every subset of free constants (5 constants: 31 small solves), the rest 0
        for free in itertools.combinations(range(a.shape[1]), k):
            theta = np.zeros(a.shape[1])
            theta[list(free)] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            cost = float(np.sum((a @ theta - b) ** 2))
            if (theta >= 0).all() and cost < best_cost - 1e-12:
                best, best_cost = theta, cost
    return best


def report(rows: list[Row]) -> tuple[np.ndarray, list[str]]:
    fits = [r for r in rows if r.role == "fit"]
    theta = fit(fits)
    lines = ["| constant | fitted |", "| --- | --- |"]
    lines += [f"| `{d}[\"{k}\"]` | {v / MiB:.2f} MiB |" for (d, k), v in zip(CONSTANTS, theta)]
    lines += ["", "| fit run | vLLM GiB | fit GiB (residual) | left out: refitted without it GiB (error) |",
              "| --- | --- | --- | --- |"]
    for r in fits:
        loo = fit([f for f in fits if f is not r])
        lines.append(f"| {r.name} | {r.measured / GiB:.2f} | {r.predict(theta) / GiB:.2f} "
                     f"({(r.predict(theta) - r.measured) / r.measured * 100:+.0f} %) | {r.predict(loo) / GiB:.2f} "
                     f"({(r.predict(loo) - r.measured) / r.measured * 100:+.0f} %) |")
    lines += ["", "| validation run | vLLM GiB | plan GiB (error) |", "| --- | --- | --- |"]
    for r in rows:
        if r.role == "validation":
            lines.append(f"| {r.name} | {r.measured / GiB:.2f} | {r.predict(theta) / GiB:.2f} "
                         f"({(r.predict(theta) - r.measured) / r.measured * 100:+.0f} %) |")
    return theta, lines


def write(theta: np.ndarray) -> None:
    path = ROOT / "kimi_k3_serve" / "planning" / "memory.py"
    text = path.read_text()
    for (d, k), v in zip(CONSTANTS, theta):
        mib = round(v / MiB, 2)
        value = "0" if mib == 0 else f"int({mib} * MiB)"
        text, n = re.subn(rf'^({d} = \{{[^\n]*"{k}": )[^,}}]+', rf"\g<1>{value}", text, count=1, flags=re.M)
        assert n == 1, d
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the fitted constants into planning/memory.py")
    args = parser.parse_args(argv)
    theta, lines = report(design())
    print("\n".join(lines))
    if args.write:
        write(theta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
