"""Fit the fitted constants of kimi_k3_serve.planning.memory on their fit runs alone, and score them out of sample.

Each group of constants predicts one measured term of vLLM's engine start, and the plan is linear in each group's
constants, so a group is fitted by non-negative least squares (relative errors) on the fit runs it names:

- ``cuda_graph``: vLLM's CUDA-graph estimate (``profile_cudagraph_memory``) is the first capture's activations plus,
  per PIECEWISE graph, ``per_graph + per_head x the target's heads on the rank``, ``per_layer x local layers`` once,
  for the FULL graphs, which vLLM samples, ``full_sampled + release_per_token_head x the second largest one's tokens
  x the target's heads on the rank`` + 1 MiB for each but the first (vLLM's floor, not fitted), and, on the last
  stage, ``draft_per_graph + draft_per_head x the draft's heads on the rank + draft_per_layer_head x the stage's
  layers x the target's heads on the rank`` per DSpark FULL graph (DSpark's own sizes, all captured), beside DSpark's
  capture workspace (the drafter's lane, from vLLM's shapes: not fitted). Fit runs: ``CUDA_GRAPH_FIT_RUNS``.
- ``profile``: the profile's memory besides the KV cache, weights and CUDA graphs: the forward's activations, the
  weights' allocator slack and, at TP2, the fused all-reduce's residuals (all from the shapes), ``NON_TORCH_TP1`` on
  one GPU, the dummy sampler's ``SAMPLER_FP32_VOCAB_COPIES`` fp32 ``max_num_seqs x vocab`` tensors and, with DSpark,
  ``DSPARK_PROFILE_LOGITS_COPIES`` bf16 draft-logit tensors of the dummy batch's speculative positions (beside its
  Markov sampling's tensors, ``memory.dspark_markov_step_bytes``, from vLLM's shapes: not fitted),
  ``DRAFT_HIDDEN_COPIES`` hidden states into the draft's step and ``DSPARK_KDA_PEAK_HIDDEN_COPIES`` at a KDA layer's
  peak (fitted factors). Fit runs: ``PROFILE_FIT_RUNS``.
- ``eagle3_drafter_graphs``: what the EAGLE3 drafter's graphs add to the CUDA-graph estimate, the high-water of its
  two capture managers: ``base + per_prefill_request x`` the requests of its largest FULL prefill graph, beside
  ``EAGLE3_DRAFTER_DECODE_PER_REQUEST`` x its largest decode graph's (read from vLLM's code, not fitted). Fit runs:
  ``EAGLE3_GRAPH_FIT_RUNS``.

Printed per group: the constants, each fit run's residual, leave-one-out over the fit runs (the group refitted
without that run, the run predicted), and the error on every validation run (which sets nothing).

    python scripts/fit_memory_constants.py          # prints every group; --write puts the fitted constants in memory.py
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
from kimi_k3_serve.units import GiB, KiB, MiB  # noqa: E402

@dataclass(frozen=True)
class Group:
    """Constants fitted together: ``(module global, dict key or None for a plain number)``, the measured term they
    predict (a ``memory_accuracy.RunAccuracy`` field) and the fit runs."""

    name: str
    constants: tuple[tuple[str, str | None], ...]
    term: str
    fit_runs: tuple[str, ...]
    kimi_only: bool = True
    integer_scale: tuple[int, ...] = ()
    """A constant that is a factor, not bytes (sampler copies): probed in whole ones, kept to 0.01."""
    kib_scale: tuple[int, ...] = ()
    """A constant of a few KiB (per layer and head): probed and kept in KiB to 0.01, where MiB to 0.01 would move it
    by a sixth."""
    runs_named: str = ""
    """Only the runs whose name holds this (the EAGLE3 drafter's group: its constants move no other run's term)."""


GROUPS = (
    Group("cuda_graph", (("CUDA_GRAPH_PER_GRAPH", "kimi_k3"), ("CUDA_GRAPH_PER_LAYER", "kimi_k3"),
                         ("CUDA_GRAPH_PER_HEAD", "kimi_k3"), ("CUDA_GRAPH_DRAFT_PER_GRAPH", "dspark"),
                         ("CUDA_GRAPH_DRAFT_PER_HEAD", "dspark"), ("CUDA_GRAPH_DRAFT_PER_LAYER_HEAD", "dspark"),
                         ("CUDA_GRAPH_FULL_SAMPLED", "kimi_k3"), ("CUDA_GRAPH_RELEASE_PER_TOKEN_HEAD", "kimi_k3")),
          "cuda_graph", memory.CUDA_GRAPH_FIT_RUNS, kib_scale=(5, 7)),
    Group("profile", (("NON_TORCH_TP1", None), ("SAMPLER_FP32_VOCAB_COPIES", None),
                      ("DSPARK_PROFILE_LOGITS_COPIES", None), ("DRAFT_HIDDEN_COPIES", "dspark"),
                      ("DSPARK_KDA_PEAK_HIDDEN_COPIES", None)), "profile",
          memory.PROFILE_FIT_RUNS, integer_scale=(1, 2, 3, 4)),
    Group("eagle3_drafter_graphs", (("EAGLE3_DRAFTER_GRAPHS_BASE", None), ("EAGLE3_DRAFTER_PER_PREFILL_REQUEST", None)),
          "cuda_graph", memory.EAGLE3_GRAPH_FIT_RUNS, runs_named="eagle3"),
)
CONSTANTS = GROUPS[0].constants
"""The CUDA-graph group's constants (tests/test_rehearsal.py checks them against the fit)."""


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


def _unit(group: Group, i: int) -> int:
    return 1 if i in group.integer_scale else KiB if i in group.kib_scale else MiB


def _unit_name(group: Group, i: int) -> str:
    """How a byte constant's unit is written (``_unit``'s name)."""
    return "KiB" if i in group.kib_scale else "MiB"


def _get(name: str, key: str | None):
    return getattr(memory, name) if key is None else getattr(memory, name).get(key)


def _set(name: str, key: str | None, value) -> None:
    if key is None:
        setattr(memory, name, value)
    else:
        getattr(memory, name)[key] = value


@contextlib.contextmanager
def constants(group: Group, values: tuple[float, ...]):
    saved = [_get(n, k) for n, k in group.constants]
    for i, ((n, k), v) in enumerate(zip(group.constants, values)):
        _set(n, k, float(v) if i in group.integer_scale else int(v))
    try:
        yield
    finally:
        for (n, k), v in zip(group.constants, saved):
            _set(n, k, v)


def _runs(group: Group) -> list[Path]:
    return [d for d in memory_accuracy.run_dirs()
            if not (group.kimi_only and d.name.startswith(("llama", "qwen", "deepseek"))) and group.runs_named in d.name]


def _estimates(group: Group, run_dirs: list[Path], values: tuple[float, ...]) -> dict[str, tuple[str, int, int]]:
    """Rank 0 of every run vLLM measured the term on: (role, the plan's term, vLLM's) at these constants."""
    out = {}
    with constants(group, values):
        for d in run_dirs:
            rows = memory_accuracy.accuracy(d)
            pair = getattr(rows[0], group.term) if rows else (0, None)
            if pair[1] and pair[0]:
                role = "fit" if d.name in group.fit_runs else "validation" if d.name not in memory_accuracy.FIT_RUNS \
                    and rows[0].role != "fit" else "other fit"
                out[d.name] = (role, pair[0], pair[1])
    return out


PROBE_STEP = 0.01
"""A probe moves one constant by this share of a unit (1 MiB, or one copy for a factor): small enough to stay on one
side of the profile's ``max`` (the KDA layer's peak against the MoE layer's and what follows it)."""


def design(group: Group = GROUPS[0], run_dirs: list[Path] | None = None,
           around: tuple[float, ...] | None = None) -> list[Row]:
    """Each run as a row of the group's model linearised at ``around`` (default: the shipped constants): the plan
    probed there and one small step from there along each constant. The profile's term is piecewise linear (a max
    of two peaks), so ``fit_piecewise`` fits, linearises again at the result and fits again until no run changes side."""
    run_dirs = run_dirs if run_dirs is not None else _runs(group)
    n = len(group.constants)
    base = tuple(around) if around is not None else tuple(_get(name, key) for name, key in group.constants)
    at = _estimates(group, run_dirs, base)
    steps = [_unit(group, i) * PROBE_STEP if i in group.integer_scale else round(_unit(group, i) * PROBE_STEP)
             for i in range(n)]  # whole bytes: a byte constant is set as an int
    moved = [_estimates(group, run_dirs, tuple(v + steps[i] if i == j else v for j, v in enumerate(base)))
             for i in range(n)]
    rows = []
    for name, (role, value, measured) in at.items():
        if not all(name in m for m in moved):
            continue
        slope = tuple((moved[i][name][1] - value) / steps[i] for i in range(n))
        rows.append(Row(name, role, measured, round(value - float(np.dot(slope, base))), slope))
    return rows


def fit_piecewise(group: Group, run_dirs: list[Path] | None = None, rounds: int = 4) -> tuple[np.ndarray, list[Row]]:
    """Fit on the fit runs, linearise again at the result, and repeat (at most ``rounds`` times)."""
    theta = np.array([float(_get(name, key)) for name, key in group.constants])
    rows = design(group, run_dirs, tuple(theta))
    for _ in range(rounds):
        new = fit([r for r in rows if r.role == "fit"])
        if np.allclose(new, theta, rtol=1e-3, atol=1e-3):
            break
        theta = new
        rows = design(group, run_dirs, tuple(theta))
    return theta, rows


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


def _label(name: str, key: str | None) -> str:
    return name if key is None else f'{name}["{key}"]'


def _shown(group: Group, i: int, value: float) -> str:
    if i in group.integer_scale:
        return f"{value:.2f} copies"
    return f"{value / _unit(group, i):.2f} {_unit_name(group, i)}"


def shipped(group: Group, theta: np.ndarray) -> np.ndarray:
    """The values the file keeps: factors, MiB and KiB to two decimals."""
    return np.array([round(v / _unit(group, i), 2) * _unit(group, i) for i, v in enumerate(theta)])


def report(rows: list[Row], group: Group = GROUPS[0]) -> tuple[np.ndarray, list[str]]:
    fits = [r for r in rows if r.role == "fit"]
    theta = fit(fits)  # the rows are linearised at the fitted constants (fit_piecewise): this is their fit again
    kept = shipped(group, theta)
    lines = [f"**{group.name}** (the {group.term.replace('_', ' ')} term)", "",
             "| constant | fitted | shipped |", "| --- | --- | --- |"]
    lines += [f"| `{_label(n, k)}` | {_shown(group, i, v)} | {_shown(group, i, kept[i])} |"
              for i, ((n, k), v) in enumerate(zip(group.constants, theta))]
    lines += ["", "| fit run | vLLM GiB | shipped GiB (residual) | left out: refitted without it GiB (error) |",
              "| --- | --- | --- | --- |"]
    for r in fits:
        loo = fit([f for f in fits if f is not r])
        lines.append(f"| {r.name} | {r.measured / GiB:.2f} | {r.predict(kept) / GiB:.2f} "
                     f"({(r.predict(kept) - r.measured) / r.measured * 100:+.0f} %) | {r.predict(loo) / GiB:.2f} "
                     f"({(r.predict(loo) - r.measured) / r.measured * 100:+.0f} %) |")
    lines += ["", "| validation run | vLLM GiB | plan GiB (error) |", "| --- | --- | --- |"]
    for r in rows:
        if r.role == "validation":
            lines.append(f"| {r.name} | {r.measured / GiB:.2f} | {r.predict(kept) / GiB:.2f} "
                         f"({(r.predict(kept) - r.measured) / r.measured * 100:+.0f} %) |")
    return theta, lines + [""]


def write(group: Group, theta: np.ndarray) -> None:
    path = ROOT / "kimi_k3_serve" / "planning" / "memory.py"
    text = path.read_text()
    for i, ((name, key), v) in enumerate(zip(group.constants, shipped(group, theta))):
        value = f"{v:.2f}" if i in group.integer_scale else "0" if v == 0 else \
            f"int({v / _unit(group, i):.2f} * {_unit_name(group, i)})"
        if key is None:
            pattern = rf"^({name} = )[^\n]+"
        else:
            pattern = rf'^({name} = \{{[^\n]*"{key}": )[^,}}]+'
        text, n = re.subn(pattern, rf"\g<1>{value}", text, count=1, flags=re.M)
        assert n == 1, name
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="put the fitted constants into planning/memory.py")
    args = parser.parse_args(argv)
    for group in GROUPS:
        theta, lines = report(fit_piecewise(group)[1], group)
        print("\n".join(lines))
        if args.write:
            write(group, theta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
