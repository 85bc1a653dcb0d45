"""``kimi-k3-serve plan``: the best layout of a model on a declared cluster, checked GPU by GPU.

    kimi-k3-serve plan --model kimi-k3 --gpu H200 --nodes 2 --max-model-len 32768
    kimi-k3-serve plan --model path/to/config.json --cluster cluster_configs/kuberay-h200.yaml --json

Without ``--max-model-len`` the model config's length is used, capped at the longest that fits the cluster
(the line ``max_model_len: ...`` says which and why; with ``--json`` it goes to standard error).

Exit codes: 0 a layout fits, 1 none fits (the closest candidates and their shortfalls are printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from kimi_k3_serve.commands.argtypes import (MAX_BATCHED_TOKENS, MAX_DP, MAX_LAYERS, MAX_NUM_SEQS, MAX_TP, fraction,
                                             int_from, nonempty, positive_int)
from kimi_k3_serve.commands.lengths import LengthChoice, given, longest_that_fits, model_config_length
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.hardware import lookup_gpu
from kimi_k3_serve.planning.inventory import MAX_DECLARED_GPUS_PER_NODE, MAX_DECLARED_NODES
from kimi_k3_serve.planning.layout import KV_CACHE_DTYPES, MAMBA_SSM_CACHE_DTYPES, MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, EngineSettings, SpeculativeSettings
from kimi_k3_serve.units import fmt_gib
from kimi_k3_serve.planning.planner import OBJECTIVES

MAX_WHAT_IF_NODES = 256
DEFAULT_SPECULATIVE_TOKENS = 3


EXAMPLES = """\
examples:
  kimi-k3-serve plan --model kimi-k3 --gpu H200 --nodes 2                 # longest max_model_len that fits
  kimi-k3-serve plan --model kimi-k3 --gpu H200 --min --max-model-len 32768
  kimi-k3-serve plan --model kimi-k3 --cluster cluster_configs/kuberay-h200.yaml --json

exit codes: 0 a layout fits, 1 none fits, 2 bad input
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--model", required=True, help="'kimi-k3', a config.json, or a checkpoint folder")
    where = parser.add_argument_group("cluster (one of)")
    where.add_argument("--gpu", help="GPU name from the catalogue, e.g. H200, B200, GB300 (with --nodes)")
    where.add_argument("--nodes", type=int_from(1, MAX_DECLARED_NODES), help="number of identical nodes (with --gpu)")
    where.add_argument("--gpus-per-node", type=int_from(1, MAX_DECLARED_GPUS_PER_NODE), help="GPUs per node (default: the catalogue's, e.g. 8; 4 on NVL72 trays)")
    where.add_argument("--cluster", type=nonempty,
                       help="cluster file: Ray cluster launcher YAML, KubeRay RayCluster/RayService, "
                            "or {nodes: [{count, gpu, gpus, free_bytes?}]}")
    where.add_argument("--as-is", action="store_true",
                       help="plan on the nodes the file starts with, not grown to each node type's max count")
    target = parser.add_argument_group("serving target")
    target.add_argument("--max-model-len", type=positive_int,
                        help="longest prompt plus output, in tokens (default: the model config's, capped at the "
                             "longest that fits the cluster)")
    target.add_argument("--max-num-seqs", type=int_from(1, MAX_NUM_SEQS), help="sequences one engine runs at once (default: vLLM's)")
    target.add_argument("--max-num-batched-tokens", type=int_from(1, MAX_BATCHED_TOKENS), help="tokens per engine step (default: vLLM's)")
    target.add_argument("--gpu-memory-utilization", type=fraction, default=0.92, help="share of each GPU vLLM may use")
    target.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    target.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=MAMBA_SSM_CACHE_DTYPES)
    target.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    target.add_argument("--enforce-eager", action="store_true")
    target.add_argument("--with-vision", action="store_true", help="load the vision tower (default: text only)")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--speculative-method", choices=SPECULATIVE_METHODS)
    spec.add_argument("--draft", help="the draft's config.json or folder")
    spec.add_argument("--num-speculative-tokens", type=int_from(1, MAX_SPECULATIVE_TOKENS),
                      help=f"tokens the draft proposes per step (default {DEFAULT_SPECULATIVE_TOKENS})")
    spec.add_argument("--draft-tp", type=int_from(1, MAX_TP), help="draft tensor parallel size: 1 or the target's TP (default)")
    pins = parser.add_argument_group("pinned choices (left to the search when absent)")
    pins.add_argument("--tp", type=int_from(1, MAX_TP))
    pins.add_argument("--pp", type=int_from(1, MAX_LAYERS))
    pins.add_argument("--ep", action=argparse.BooleanOptionalAction, default=None, help="expert parallelism")
    pins.add_argument("--dp", type=int_from(1, MAX_DP))
    pins.add_argument("--layer-partition", help="layers per PP stage, e.g. 31,30 (VLLM_PP_LAYER_PARTITION)")
    parser.add_argument("--objective", default="fewest-nodes", choices=OBJECTIVES,
                        help="how to rank layouts that fit (default: fewest nodes, then most concurrency)")
    parser.add_argument("--min", action="store_true", dest="smallest",
                        help="what-if: the smallest cluster of --gpu nodes that fits, and the best layout on it")
    parser.add_argument("--max-nodes", type=int_from(1, MAX_DECLARED_NODES), default=MAX_WHAT_IF_NODES,
                        help=f"largest cluster --min and the what-if search try (default {MAX_WHAT_IF_NODES} nodes)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _cluster(args: argparse.Namespace):
    from kimi_k3_serve.cluster.files import load_cluster_file
    from kimi_k3_serve.planning.inventory import declared_cluster

    if args.cluster and (args.gpu or args.nodes):
        raise ConfigError("--cluster", args.cluster, "either --cluster FILE or --gpu NAME --nodes N, not both")
    if args.cluster:
        inventory = load_cluster_file(args.cluster)
        return inventory if args.as_is else inventory.at_capacity()
    if not args.gpu or args.nodes is None:
        raise ConfigError("--gpu/--nodes", [args.gpu, args.nodes], "both --gpu NAME and --nodes N, or --cluster FILE")
    return declared_cluster(args.gpu, args.nodes, args.gpus_per_node)


def _partition(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError("--layer-partition", text, "comma-separated layer counts, e.g. 31,30") from None


def _engine(args: argparse.Namespace) -> EngineSettings:
    from kimi_k3_serve.models import load_model

    speculative = None
    if args.speculative_method or args.draft:
        if not (args.speculative_method and args.draft):
            raise ConfigError("--speculative-method/--draft", [args.speculative_method, args.draft],
                              "both: the draft family and its config.json or folder")
        try:
            draft = load_model(args.draft)
        except ConfigError as exc:  # load_model names its argument "model": here it is the draft
            raise ConfigError("--draft", exc.value, exc.allowed) from None
        speculative = SpeculativeSettings(args.speculative_method,
                                          args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
                                          draft=draft, draft_tp=args.draft_tp)
    else:
        for flag, value in (("--num-speculative-tokens", args.num_speculative_tokens), ("--draft-tp", args.draft_tp)):
            if value is not None:  # silently planning without a draft would answer another question
                raise ConfigError(flag, value, "only with --speculative-method and --draft")
    return EngineSettings(
        max_model_len=args.max_model_len or model_config_length(load_model(args.model)),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        speculative=speculative,
        language_model_only=not args.with_vision,
        enforce_eager=args.enforce_eager,
    )


_FLAG_OF_PIN = {"tp": "--tp", "pp": "--pp", "dp": "--dp", "ep": "--ep", "layer_partition": "--layer-partition",
                "gpus_per_node": "--gpus-per-node", "speculative.method": "--speculative-method",
                "speculative.draft": "--draft"}


def run(args: argparse.Namespace) -> int:
    """Name the command-line flag in an error about a pin that came from one (the planner names its pins)."""
    try:
        return _run(args)
    except ConfigError as exc:
        flag = _FLAG_OF_PIN.get(exc.field)
        if flag is None:
            raise
        raise type(exc)(flag, exc.value, exc.allowed, source=exc.source) from None


def _run(args: argparse.Namespace) -> int:
    from kimi_k3_serve.models import load_model
    from kimi_k3_serve.planning.memory import check_draft
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, Pins, plan, validate_length

    if args.gpu is not None:
        lookup_gpu(args.gpu, field="--gpu")  # an unknown name: one line listing the catalogue
    if args.as_is and not args.cluster:
        raise ConfigError("--as-is", True, "only with --cluster FILE: it plans on the nodes a file starts with")
    model = load_model(args.model)
    if args.max_model_len:
        validate_length(model, args.max_model_len, field="--max-model-len")
    engine = _engine(args)
    if engine.speculative is not None:
        check_draft(model, engine.speculative)
    pins = Pins(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, layer_partition=_partition(args.layer_partition))
    if args.max_nodes < 1:
        raise ConfigError("--max-nodes", args.max_nodes, "an integer >= 1")
    if args.smallest:
        if args.cluster or args.nodes is not None or not args.gpu:
            raise ConfigError("--min", [args.gpu, args.nodes, args.cluster],
                              "--gpu NAME without --nodes or --cluster: --min finds the node count itself")
        choice = given(engine.max_model_len) if args.max_model_len else LengthChoice(
            engine.max_model_len, "model config", f"max_model_len: {engine.max_model_len:,} (model config)")
        print(choice.line, file=sys.stderr if args.json else sys.stdout)
        return _run_smallest(args, model, engine, pins)
    cluster = _cluster(args)
    choice = _length(args, model, engine, cluster, pins)
    engine = replace(engine, max_model_len=choice.value)
    print(choice.line, file=sys.stderr if args.json else sys.stdout)
    try:
        result = plan(model, engine, cluster, pins, objective=args.objective)
    except NoLayoutFitsError as exc:
        what_if = what_would_fit(model, engine, pins, args, cluster) if args.gpu else None
        if args.json:
            json.dump({**exc.to_json(), "max_model_len_choice": choice.to_json(),
                       **({"what_would_fit": what_if} if what_if else {})}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"does not fit: {exc}")
            _print_candidates(exc.candidates)
            if what_if:
                _print_what_if(what_if)
        return 1
    if args.json:
        json.dump({**result.to_json(), "max_model_len_choice": choice.to_json()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_plan(result)
    return 0


def _length(args: argparse.Namespace, model, engine: EngineSettings, cluster, pins) -> LengthChoice:
    """``--max-model-len`` as given, else the model config's, capped at the longest at which a layout fits."""
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, plan

    if args.max_model_len:
        return given(args.max_model_len)

    def fits(length: int) -> bool:
        try:
            plan(model, replace(engine, max_model_len=length), cluster, pins, objective=args.objective)
        except NoLayoutFitsError:
            return False
        return True

    return longest_that_fits(model_config_length(model), fits)


def _print_candidates(candidates: list) -> None:
    print("closest layouts:")
    for c in candidates:
        if c.report is None:
            print(f"  {c.layout.describe():<28} {c.layout.world_size:>4} GPUs  not placeable: {c.reason}")
        elif c.fits:
            print(f"  {c.layout.describe():<28} {c.layout.world_size:>4} GPUs  fits, max concurrency "
                  f"{float(c.report.max_concurrency):.2f}")
        else:
            print(f"  {c.layout.describe():<28} {c.layout.world_size:>4} GPUs  short {fmt_gib(c.shortfall_bytes)} "
                  f"(rank {c.report.binding_rank})")


def _field(rank: dict[str, Any], name: str) -> str:
    value = rank.get(name)
    return fmt_gib(value) if isinstance(value, (int, float)) else "-"


def _print_plan(result) -> None:
    data = result.to_json()
    layout = data["layout"]
    print(f"{result.model.name} on {data['cluster']}: {layout['describe']} = {result.layout.world_size} x {data['gpu']}")
    print(f"fits: yes; max concurrency at {result.engine.max_model_len} tokens: {float(data['max_concurrency']):.2f} "
          f"({data['kv_cache_tokens']} KV tokens, {data['num_blocks']} blocks); last stage on "
          f"{', '.join(data['last_stage_nodes'])}")
    print(f"{'rank':>4} {'stage':>5} {'node':<18} {'gpu':>3} {'weights':>12} {'kv cache':>12} {'headroom':>12}")
    for rank in data["ranks"]:
        print(f"{rank.get('rank', '?'):>4} {rank.get('pp_stage', '?'):>5} {str(rank.get('node')):<18} "
              f"{str(rank.get('gpu_index')):>3} {_field(rank, 'weights_bytes'):>12} {_field(rank, 'kv_cache_bytes'):>12} "
              f"{_field(rank, 'headroom_bytes'):>12}")
    print("optimisations:")
    for name, item in data["optimisations"].items():
        print(f"  {name:<24} {'on ' if item['on'] else 'off'}  {item['reason']}")
    print("engine_kwargs: " + json.dumps(data["engine_kwargs"]))
    print("env_vars: " + json.dumps(data["env_vars"]))
    pg = data["placement_group_config"]
    print(f"placement_group_config: {len(pg['bundles'])} x {json.dumps(pg['bundles'][0])}, strategy {pg['strategy']}"
          + (f" (per Serve replica = DP rank; {result.layout.dp} gang-scheduled)" if result.layout.dp > 1 else ""))
    print(f"searched {len(result.considered)} layouts in {result.search_seconds:.3f} s")
    if result.rationale:
        print(f"why: {result.rationale}")


# ---------------------------------------------------------------------------------------------------------------
# What-if: the smallest cluster that fits
# ---------------------------------------------------------------------------------------------------------------


def smallest_cluster(model, engine, pins, gpu: str, gpus_per_node: int | None, *, objective: str, max_nodes: int):
    """(nodes, plan) for the fewest nodes of ``gpu`` on which a layout fits, or (None, closest error) when even
    ``max_nodes`` nodes are not enough. More nodes only add choices, so the answer is found by doubling, then
    bisection: a few dozen plans at most."""
    from kimi_k3_serve.planning.inventory import declared_cluster
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, plan

    tried: dict[int, object] = {}

    def attempt(nodes: int):
        if nodes not in tried:
            try:
                tried[nodes] = plan(model, engine, declared_cluster(gpu, nodes, gpus_per_node), pins, objective=objective)
            except NoLayoutFitsError as exc:
                tried[nodes] = exc
        return tried[nodes]

    lo, hi = 0, None  # attempt(lo) does not fit (or lo == 0); attempt(hi) fits
    nodes = 1
    while nodes <= max_nodes:
        if not isinstance(attempt(nodes), NoLayoutFitsError):
            hi = nodes
            break
        lo, nodes = nodes, nodes * 2
    if hi is None:
        if lo < max_nodes and not isinstance(attempt(max_nodes), NoLayoutFitsError):
            hi = max_nodes
        else:
            return None, attempt(max_nodes)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if isinstance(attempt(mid), NoLayoutFitsError):
            lo = mid
        else:
            hi = mid
    return hi, attempt(hi)


def what_would_fit(model, engine, pins, args: argparse.Namespace, cluster) -> dict[str, Any]:
    """For a declared ``--gpu --nodes`` cluster that is too small: by how much (the checkpoint against all the
    GPUs' budgets), how many nodes of that GPU would do, and which catalogue GPUs would on as many nodes."""
    from kimi_k3_serve.planning.inventory import declared_cluster
    from kimi_k3_serve.planning.hardware import CATALOGUE
    from kimi_k3_serve.planning.planner import NoLayoutFitsError, plan

    gpus = [g for node in cluster.gpu_nodes for g in node.gpus]
    budget = sum(int(g.total_bytes * engine.gpu_memory_utilization) for g in gpus)
    out: dict[str, Any] = {
        "checkpoint_bytes": model.checkpoint_bytes,
        "cluster_gpus": len(gpus),
        "cluster_budget_bytes": budget,
    }
    nodes, found = smallest_cluster(model, engine, pins, args.gpu, args.gpus_per_node, objective=args.objective,
                                    max_nodes=args.max_nodes)
    if nodes is not None:
        out["same_gpu"] = {"gpu": found.gpu_name, "nodes": nodes,
                           "cluster_gpus": declared_cluster(args.gpu, nodes, args.gpus_per_node).total_gpus,
                           "gpus": found.layout.world_size, "layout": found.layout.describe(),
                           "max_concurrency": float(found.report.max_concurrency)}
    else:
        out["same_gpu"] = {"gpu": args.gpu, "nodes": None, "reason": f"no layout fits even {args.max_nodes} nodes: {found}"}
    others = []
    for spec in CATALOGUE:
        try:
            other = plan(model, engine, declared_cluster(spec.name, args.nodes), pins, objective=args.objective)
        except NoLayoutFitsError:
            continue
        except ConfigError:
            continue
        others.append({"gpu": spec.name, "nodes": args.nodes, "gpus": other.layout.world_size,
                       "layout": other.layout.describe(), "max_concurrency": float(other.report.max_concurrency)})
    out["other_gpus_same_nodes"] = others
    return out


def _print_what_if(what_if: dict[str, Any]) -> None:
    print(f"by how much: the checkpoint alone is {fmt_gib(what_if['checkpoint_bytes'])}; the {what_if['cluster_gpus']} "
          f"GPUs give vLLM {fmt_gib(what_if['cluster_budget_bytes'])} in all at this gpu_memory_utilization")
    same = what_if["same_gpu"]
    if same.get("nodes"):
        print(f"what would fit: {same['nodes']} nodes of {same['gpu']} ({same['cluster_gpus']} GPUs), with "
              f"{same['layout']} on {same['gpus']} of them, {same['max_concurrency']:.2f} requests at max_model_len")
    else:
        print(f"what would fit: not {same['gpu']} -- {same['reason']}")
    others = what_if["other_gpus_same_nodes"]
    if others:
        print("on as many nodes of another GPU:")
        for item in others:
            print(f"  {item['gpu']:<10} {item['layout']:<28} {item['gpus']:>4} GPUs  {item['max_concurrency']:.2f} requests")
    else:
        print("no GPU of the catalogue fits on as many nodes")


def _run_smallest(args: argparse.Namespace, model, engine, pins) -> int:
    import time

    started = time.perf_counter()
    nodes, found = smallest_cluster(model, engine, pins, args.gpu, args.gpus_per_node, objective=args.objective,
                                    max_nodes=args.max_nodes)
    seconds = time.perf_counter() - started
    if nodes is None:
        if args.json:
            json.dump({"fits": False, "gpu": args.gpu, "max_nodes": args.max_nodes, "reason": str(found),
                       "candidates": [c.summary() for c in found.candidates]}, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print(f"no cluster of up to {args.max_nodes} {args.gpu} nodes fits {model.name}: {found}")
            _print_candidates(found.candidates)
        return 1
    if args.json:
        json.dump({"smallest_nodes": nodes, **found.to_json(), "what_if_seconds": round(seconds, 4)}, sys.stdout,
                  indent=2)
        sys.stdout.write("\n")
    else:
        print(f"smallest cluster: {nodes} node(s) of {found.gpu_name} ({nodes - 1} would not fit); "
              f"found in {seconds:.3f} s")
        _print_plan(found)
    return 0
