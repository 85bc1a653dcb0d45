#!/usr/bin/env python3
"""How fast the capacity check answers: cold-process wall times, import costs, and planner time against
cluster size.

    python scripts/bench_planner.py                                  # everything, default sizes
    python scripts/bench_planner.py --nodes 1 2 4 --repeats 3 --no-cold --json out.json --plot out.png

Three measurements:
- cold processes: ``kimi-k3-serve check`` on the shipped H200 cluster file, ``kimi-k3-serve plan`` and
  ``python -c "import kimi_k3_serve.planning.planner"``, each started afresh several times (median, min, max);
- import costs: ``python -X importtime`` of a statement, the heaviest modules by cumulative time, and whether
  anything heavy (Ray, vLLM, torch, pydantic, yaml) was pulled in;
- planner scaling: ``plan()`` of Kimi-K3 on declared clusters of 1 to 1,024 nodes of 8 H200, in process, for
  every objective: median seconds, layouts evaluated, the chosen layout.

Importable by tests: ``planner_scaling``, ``import_costs``, ``cold_process_times``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
HEAVY_MODULES = ("ray", "vllm", "torch", "pydantic", "yaml", "numpy", "fastapi")
CHECK_CONFIG = "deploy/config.yaml"
CHECK_CLUSTER = "cluster_configs/aws-h200-p5en.yaml"


# ---------------------------------------------------------------------------------------------------------------
# Planner time against cluster size (in process)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingRow:
    objective: str
    nodes: int
    gpus: int
    cluster_seconds: float
    """Median time to build the declared cluster inventory."""
    plan_seconds: float
    """Median time of ``plan()`` (search, placement, memory check of every candidate)."""
    plan_seconds_min: float
    plan_seconds_max: float
    layouts_evaluated: int
    fits: bool
    layout: str


def planner_scaling(
    node_counts: tuple[int, ...] | list[int] = DEFAULT_NODES,
    *,
    gpu: str = "H200",
    objectives: tuple[str, ...] | None = None,
    max_model_len: int = 32768,
    repeats: int = 5,
) -> list[ScalingRow]:
    """One row per (objective, node count): Kimi-K3 planned on ``nodes`` declared nodes of ``gpu``."""
    from kimi_k3_serve.planning.inventory import declared_cluster
    from kimi_k3_serve.planning.layout import EngineSettings
    from kimi_k3_serve.models import load_model
    from kimi_k3_serve.planning.planner import OBJECTIVES, NoLayoutFitsError, plan

    model = load_model("kimi-k3")
    engine = EngineSettings(max_model_len=max_model_len)
    plan(model, engine, declared_cluster(gpu, 2))  # warm-up: the first call pays one-time costs (caches, imports)
    rows = []
    for objective in objectives or OBJECTIVES:
        for nodes in node_counts:
            build_times, plan_times = [], []
            for _ in range(max(1, repeats)):
                started = time.perf_counter()
                cluster = declared_cluster(gpu, nodes)
                built = time.perf_counter()
                try:
                    result = plan(model, engine, cluster, objective=objective)
                    outcome = (len(result.considered), True, result.layout.describe())
                except NoLayoutFitsError as exc:
                    # plan() keeps every candidate only on success; on failure it says how it failed.
                    outcome = (None, False, f"does not fit: {exc}")
                plan_times.append(time.perf_counter() - built)
                build_times.append(built - started)
            evaluated, fits, layout = outcome
            if evaluated is None:
                evaluated = _count_evaluations(model, engine, cluster, objective)
            rows.append(ScalingRow(
                objective=objective,
                nodes=nodes,
                gpus=cluster.total_gpus,
                cluster_seconds=statistics.median(build_times),
                plan_seconds=statistics.median(plan_times),
                plan_seconds_min=min(plan_times),
                plan_seconds_max=max(plan_times),
                layouts_evaluated=evaluated,
                fits=fits,
                layout=layout,
            ))
    return rows


def _count_evaluations(model, engine, cluster, objective: str) -> int:
    """Layouts a failing plan() evaluated: counted by wrapping the planner's ``evaluate`` for one more run."""
    import kimi_k3_serve.planning.planner as planner

    original = planner.evaluate
    calls = 0

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    planner.evaluate = counting
    try:
        planner.plan(model, engine, cluster, objective=objective)
    except planner.NoLayoutFitsError:
        pass
    finally:
        planner.evaluate = original
    return calls


# ---------------------------------------------------------------------------------------------------------------
# Cold processes and import costs (subprocesses)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ColdRow:
    name: str
    command: str
    runs: int
    median_seconds: float
    min_seconds: float
    max_seconds: float
    exit_code: int


def cold_process_times(commands: dict[str, list[str]], *, runs: int = 7, cwd: Path = REPO_ROOT) -> list[ColdRow]:
    """Wall time of each command started as a new process ``runs`` times (output discarded)."""
    rows = []
    for name, argv in commands.items():
        times, code = [], 0
        for _ in range(max(1, runs)):
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            times.append(time.perf_counter() - started)
            code = done.returncode
            if code not in (0, 1):
                raise RuntimeError(f"{name}: exit code {code}: {done.stderr.strip()[-2000:]}")
        rows.append(ColdRow(name, " ".join(_shown(a) for a in argv), len(times), statistics.median(times),
                            min(times), max(times), code))
    return rows


def _shown(arg: str) -> str:
    """An argument as the docs show it: the interpreter and console scripts by name, not by absolute path."""
    path = Path(arg)
    if path.is_absolute() and path.parent == Path(sys.executable).parent:
        return path.name
    return f'"{arg}"' if " " in arg else arg


def default_cold_commands() -> dict[str, list[str]]:
    python = sys.executable
    cli = [python, "-m", "kimi_k3_serve.cli"]
    return {
        "check (H200 cluster file)": [*cli, "check", "--config", CHECK_CONFIG, "--cluster", CHECK_CLUSTER],
        "plan --gpu H200 --nodes 2": [*cli, "plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2",
                                      "--max-model-len", "32768"],
        "import kimi_k3_serve.planning.planner": [python, "-c", "import kimi_k3_serve.planning.planner"],
        "import ray.serve.schema": [python, "-c", "import ray.serve.schema"],
        "python (empty)": [python, "-c", "pass"],
    }


CHECK_STATEMENT = (
    "import contextlib, io; from kimi_k3_serve.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()): "
    f"code = main(['check', '--config', '{CHECK_CONFIG}', '--cluster', '{CHECK_CLUSTER}'])"
)


def check_breakdown(*, cwd: Path = REPO_ROOT) -> dict[str, Any]:
    """``check`` timed inside two cold processes: as shipped (the deploy config is accepted against the snapshot
    of Ray Serve's schema, Ray is not imported), and with that shortcut off, as for a config that uses a field
    the snapshot does not cover (``ray.serve.schema`` is imported and decides)."""
    result: dict[str, Any] = {}
    for label, prelude in (("shortcut", ""), ("ray_schema", "import kimi_k3_serve.config.serve_schema as s; "
                                                             "s.accepts_without_ray = lambda document: False\n")):
        script = (
            "import json, sys, time; t0 = time.perf_counter()\n"
            f"{prelude}{CHECK_STATEMENT}\n"
            "print(json.dumps({'seconds': time.perf_counter() - t0, 'ray_imported': 'ray' in sys.modules, "
            "'exit_code': code}))"
        )
        done = subprocess.run([sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, check=True)
        result[label] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@dataclass(frozen=True)
class ImportCost:
    statement: str
    total_seconds: float
    """Cumulative import time of every top-level import the statement made (``-X importtime``)."""
    heavy: tuple[str, ...]
    """Heavy top-level packages that were imported (any of ``HEAVY_MODULES``)."""
    top: tuple[tuple[str, float], ...]
    """The modules with the largest cumulative import time, seconds."""


def import_costs(statement: str, *, top: int = 8, cwd: Path = REPO_ROOT) -> ImportCost:
    """``python -X importtime -c STATEMENT``, parsed."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], cwd=cwd,
                          capture_output=True, text=True, check=True)
    entries: list[tuple[str, int, int]] = []  # (module, cumulative us, depth)
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        depth = (len(name) - len(name.lstrip())) // 2
        entries.append((name.strip(), int(cumulative), depth))
    base = min((d for _, _, d in entries), default=0)
    # Python's own start-up imports (site, encodings) are top-level too; count only what the statement asked for.
    startup = _startup_modules()
    roots = [(n, c) for n, c, d in entries if d == base and n not in startup]
    loaded = {n.split(".")[0] for n, _, _ in entries}
    ranked = sorted(((n, c) for n, c, _ in entries if n not in startup), key=lambda e: -e[1])[:top]
    return ImportCost(
        statement=statement,
        total_seconds=sum(c for _, c in roots) / 1e6,
        heavy=tuple(m for m in HEAVY_MODULES if m in loaded),
        top=tuple((n, c / 1e6) for n, c in ranked),
    )


def _startup_modules() -> set[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, check=True)
    return {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "load_average": load,
    }


def plot_scaling(rows: list[ScalingRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_per) = plt.subplots(1, 2, figsize=(9.5, 3.6), dpi=110)
    for objective in dict.fromkeys(r.objective for r in rows):
        mine = [r for r in rows if r.objective == objective]
        gpus = [r.gpus for r in mine]
        ax_time.plot(gpus, [r.plan_seconds * 1e3 for r in mine], marker="o", ms=3, label=objective)
        ax_per.plot(gpus, [r.plan_seconds * 1e3 / max(1, r.layouts_evaluated) for r in mine], marker="o", ms=3,
                    label=objective)
    # A line of slope 1 through the largest default-objective point: "linear in GPUs" for comparison.
    ref = [r for r in rows if r.objective == rows[0].objective]
    big = ref[-1]
    xs = [ref[0].gpus, big.gpus]
    ax_time.plot(xs, [big.plan_seconds * 1e3 * x / big.gpus for x in xs], "k--", lw=0.8, label="linear in GPUs")
    for ax, title in ((ax_time, "plan() time"), (ax_per, "time per layout evaluated")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs in the declared cluster (8 H200 per node)")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
    ax_time.legend(fontsize=7)
    fig.suptitle("Kimi-K3 planner, max_model_len 32768, one CPU core", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _print_scaling(rows: list[ScalingRow]) -> None:
    print(f"{'objective':<16} {'nodes':>5} {'GPUs':>5} {'cluster ms':>10} {'plan ms':>8} {'min':>7} {'max':>7} "
          f"{'layouts':>7}  layout")
    for r in rows:
        print(f"{r.objective:<16} {r.nodes:>5} {r.gpus:>5} {r.cluster_seconds * 1e3:>10.2f} {r.plan_seconds * 1e3:>8.1f} "
              f"{r.plan_seconds_min * 1e3:>7.1f} {r.plan_seconds_max * 1e3:>7.1f} {r.layouts_evaluated:>7}  "
              f"{r.layout[:70]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=list(DEFAULT_NODES), help="declared node counts")
    parser.add_argument("--repeats", type=int, default=5, help="plan() runs per point (median reported)")
    parser.add_argument("--runs", type=int, default=7, help="cold-process runs per command")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-process and import measurements")
    parser.add_argument("--json", type=Path, help="write every number as JSON here")
    parser.add_argument("--plot", type=Path, help="write the scaling plot (PNG) here")
    args = parser.parse_args(argv)

    report: dict = {"machine": machine()}
    print("machine: " + ", ".join(f"{k} {v}" for k, v in report["machine"].items()))
    if not args.no_cold:
        cold = cold_process_times(default_cold_commands(), runs=args.runs)
        report["cold"] = [asdict(r) for r in cold]
        print(f"\n{'cold process':<30} {'median s':>9} {'min s':>7} {'max s':>7}  exit")
        for r in cold:
            print(f"{r.name:<30} {r.median_seconds:>9.3f} {r.min_seconds:>7.3f} {r.max_seconds:>7.3f}  {r.exit_code}")
        report["check_breakdown"] = check_breakdown()
        split = report["check_breakdown"]
        for label, words in (("shortcut", "as shipped"), ("ray_schema", "with Ray's schema deciding")):
            run = split[label]
            print(f"\ncheck in one process, {words}: {run['seconds']:.3f} s, Ray imported: {run['ray_imported']} "
                  f"(exit {run['exit_code']})", end="")
        print()
        imports = [import_costs(s) for s in ("import kimi_k3_serve.planning.planner",
                                             "import kimi_k3_serve.cli; kimi_k3_serve.cli.build_parser()",
                                             CHECK_STATEMENT)]
        report["imports"] = [asdict(i) for i in imports]
        for cost in imports:
            print(f"\n-X importtime: {cost.statement}: {cost.total_seconds:.3f} s; heavy packages: "
                  f"{', '.join(cost.heavy) or 'none'}")
            for name, seconds in cost.top:
                print(f"  {seconds:8.3f} s  {name}")
    rows = planner_scaling(args.nodes, repeats=args.repeats)
    report["scaling"] = [asdict(r) for r in rows]
    report["machine"]["load_average_after"] = machine()["load_average"]
    print()
    _print_scaling(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_scaling(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
