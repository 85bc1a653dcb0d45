"""``kimi-k3-serve rehearse``: start vLLM's real engine on dummy weights, exactly as ``serve run`` would configure
it, and print what vLLM measured per GPU beside the plan's prediction.

Examples:
  kimi-k3-serve rehearse --config deploy/gpu-rehearsal.yaml            # a deploy config's engine, dummy weights
  kimi-k3-serve rehearse --config deploy/config.yaml --layers 4 --tp 1 --pp 1   # Kimi-K3's architecture on 1 GPU
  kimi-k3-serve rehearse --model kimi-k3 --layers 4 --tp 2 --max-model-len 8192 --json
  kimi-k3-serve rehearse --model kimi-k3 --layers 4 --dp 2 --enable-expert-parallel   # DP2 x EP2 on 2 GPUs
  kimi-k3-serve rehearse --config deploy/config.yaml --dry-run          # what would start, no GPU needed
  kimi-k3-serve rehearse --config deploy/config.yaml --rank-of 1        # one TP8 rank of stage 1, full depth, 1 GPU
  kimi-k3-serve rehearse --config deploy/config.yaml --stage-of 0       # stage 0 at TP8 on one node of 8 GPUs

The engine kwargs and env are the ones the application builder deploys (``args_adapter.vllm_engine_args_of``,
the plan's one translation to vLLM), plus ``load_format: dummy``; limits a config leaves unset are resolved as the Serve replica's vLLM resolves them.
On one host the engine uses vLLM's multiprocessing executor (``--executor ray`` uses Ray's, on the Ray cluster of
``RAY_ADDRESS``). ``--layers N`` rehearses the first N layers of a Kimi-K3 (every layer kind kept) and its draft.
``--rank-of STAGE`` rehearses one TP rank of that pipeline stage of the config's layout on one GPU: the stage's
layers in their own order, at one rank's shapes (``rehearsal/rank_slice.py``), the draft on the last stage; the
output sets the plan of the real rank beside it, with every term the slice cannot show. ``--stage-of STAGE``
rehearses the whole stage at the layout's TP on one node (a model of the stage's layers at full width, the draft on
the last stage): what TP itself allocates (NCCL, NVLS, all-reduce buffers) is then measured, not estimated.
Exit code: 0 vLLM started and generated; 1 it did not (the table says where and why); 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from kimi_k3_serve.commands.argtypes import MAX_DP, MAX_LAYERS, MAX_PP, MAX_TP, fraction, int_from, positive_int
from kimi_k3_serve.errors import ConfigError

if TYPE_CHECKING:
    from kimi_k3_serve.config.args import ServeArgs

EXIT_STARTED, EXIT_FAILED = 0, 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1].replace("``", "`")
    parser.add_argument("--config", help="a Serve deploy config whose application is kimi_k3_serve.app:build_app")
    parser.add_argument("--app", default=None, help="the application's name in --config (default: the only one)")
    parser.add_argument("--model", default=None, help="without --config: kimi-k3, a config.json or a checkpoint folder")
    parser.add_argument("--tp", type=int_from(1, MAX_TP), default=None, help="tensor parallel size (overrides --config)")
    parser.add_argument("--pp", type=int_from(1, MAX_LAYERS), default=None, help="pipeline parallel size (overrides --config)")
    parser.add_argument("--dp", type=int_from(1, MAX_DP), default=None,
                        help="data parallel size (overrides --config): one engine per DP rank, on TP x PP GPUs each")
    parser.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="split the experts over the TP x DP ranks (overrides --config)")
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="overrides --config (default without it: 4096)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=None)
    parser.add_argument("--kv-cache-dtype", default=None)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 7}\'; '
                             '"none" drops the config\'s draft')
    parser.add_argument("--engine-kwargs", default=None, help="JSON of extra vLLM engine arguments, merged over the config's")
    parser.add_argument("--layers", type=int_from(1, MAX_LAYERS), default=None, help="rehearse a Kimi-K3 slice of this many layers")
    parser.add_argument("--rank-of", type=int_from(0, MAX_PP - 1), default=None, metavar="STAGE",
                        help="rehearse one TP rank of this pipeline stage (0-based) of the config's layout on one GPU")
    parser.add_argument("--stage-of", type=int_from(0, MAX_PP - 1), default=None, metavar="STAGE",
                        help="rehearse this pipeline stage (0-based) of the config's layout at its TP on one node's "
                             "GPUs, as a model of its own at full width")
    parser.add_argument("--env", action="append", default=None, metavar="NAME=VALUE",
                        help="an engine environment variable over the config's (args.runtime_env.env_vars); repeatable, "
                             "e.g. --env NCCL_NVLS_ENABLE=0")
    parser.add_argument("--executor", choices=("mp", "ray"), default="mp", help="vLLM's executor (default mp: one host)")
    parser.add_argument("--work-dir", default=None, help="where model configs, the spec and the log go (default: a temp dir)")
    parser.add_argument("--timeout", type=positive_int, default=1800.0, help="seconds before the engine is stopped (default 1800)")
    parser.add_argument("--dry-run", action="store_true", help="print the engine kwargs, env and prediction; start nothing")
    parser.add_argument("--start-anyway", action="store_true",
                        help="start vLLM even when the plan refuses the settings, to see what vLLM does with them")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


# -- the rehearsal's args: a deploy config's, or one made from flags ------------------------------------------------

def _json_flag(text: str | None, flag: str) -> Any:
    if text is None:
        return None
    from kimi_k3_serve.inputs import load_json

    return load_json(text, flag, text)


def serve_args_of(ns: argparse.Namespace) -> ServeArgs:
    """The ``ServeArgs`` to rehearse: the deploy config's (or a GPU config made from the flags), flags applied."""
    from kimi_k3_serve.config.args import load_args

    if ns.config and ns.model is not None:
        raise ConfigError("--model", ns.model, "only without --config: the config's args.model.source is the model")
    if ns.config:
        from kimi_k3_serve.config.serve_config import load_serve_app

        raw = load_serve_app(ns.config, app_name=ns.app).args.model_dump(exclude_none=True)
    else:
        raw = {"model": {"id": "rehearsal", "source": ns.model or "moonshotai/Kimi-K3"},
               "accelerator": {"kind": "gpu"}, "limits": {"max_model_len": 4096}}
    raw["accelerator"] = {**raw.get("accelerator", {}), "kind": "gpu"}
    parallel = raw.setdefault("parallel", {})
    if ns.tp is not None:
        parallel["tensor_parallel_size"] = ns.tp
    if getattr(ns, "dp", None) is not None:
        parallel["data_parallel_size"] = ns.dp
    if getattr(ns, "enable_expert_parallel", None) is not None:
        parallel["enable_expert_parallel"] = ns.enable_expert_parallel
    if ns.pp is not None:
        parallel["pipeline_parallel_size"] = ns.pp
        if parallel.get("layer_partition") and len(parallel["layer_partition"]) != ns.pp:
            parallel.pop("layer_partition")
    limits = raw.setdefault("limits", {})
    for flag, key in (("max_model_len", "max_model_len"), ("max_num_seqs", "max_num_seqs"),
                      ("max_num_batched_tokens", "max_num_batched_tokens"),
                      ("gpu_memory_utilization", "gpu_memory_utilization"), ("kv_cache_dtype", "kv_cache_dtype"),
                      ("enforce_eager", "enforce_eager")):
        if getattr(ns, flag) is not None:
            limits[key] = getattr(ns, flag)
    if ns.speculative_config is not None:
        if ns.speculative_config.strip().lower() == "none":
            raw.pop("speculative", None)
        else:
            spec = _json_flag(ns.speculative_config, "--speculative-config")
            if not isinstance(spec, dict):
                raise ConfigError("--speculative-config", ns.speculative_config, "expected a JSON object")
            raw["speculative"] = spec
    extra = _json_flag(ns.engine_kwargs, "--engine-kwargs")
    if extra is not None:
        if not isinstance(extra, dict):
            raise ConfigError("--engine-kwargs", ns.engine_kwargs, "expected a JSON object")
        raw["engine_kwargs"] = {**raw.get("engine_kwargs", {}), **extra}
    for item in getattr(ns, "env", None) or ():
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ConfigError("--env", item, "NAME=VALUE, NAME a variable name (letters, digits and _, not first a digit)")
        raw.setdefault("runtime_env", {}).setdefault("env_vars", {})[name] = value
    return load_args(raw, source=ns.config or "rehearse flags")


def _flag_of(field: str, ns: argparse.Namespace) -> str | None:
    """The command-line flag that set ``field`` (``args.limits.kv_cache_dtype`` from ``--kv-cache-dtype``), or None
    where the value came from the config file: an error must blame what the user typed, not the file."""
    parts = field.split(".")
    if len(parts) < 3 or parts[0] != "args":
        return None
    section, key = parts[1], parts[2].split("[")[0]
    given = {("parallel", "tensor_parallel_size"): "tp", ("parallel", "pipeline_parallel_size"): "pp",
             ("parallel", "data_parallel_size"): "dp", ("parallel", "enable_expert_parallel"): "enable_expert_parallel"}
    if section == "limits":
        given[("limits", key)] = key
    if (section, key) in given and getattr(ns, given[(section, key)], None) is not None:
        return "--" + given[(section, key)].replace("_", "-")
    if section == "speculative" and ns.speculative_config is not None:
        return f"--speculative-config.{key}"
    if section == "engine_kwargs" and ns.engine_kwargs is not None and f'"{key}"' in ns.engine_kwargs:
        return f"--engine-kwargs.{key}"
    if section == "runtime_env" and len(parts) > 3 and any(e.partition("=")[0] == parts[3] for e in ns.env or ()):
        return f"--env {parts[3]}"
    if section == "model" and key == "source" and not ns.config:
        return "--model"
    return None


def _model_config(source: str, field: str) -> tuple[dict[str, Any], Path | None]:
    """(config.json, the folder to load weights/tokenizer from or None for a shipped config) of a source."""
    from kimi_k3_serve.config.args import resolve_source
    from kimi_k3_serve.config.args_adapter import SHIPPED_MODEL_IDS
    from kimi_k3_serve.models import SHIPPED, read_config

    name = SHIPPED_MODEL_IDS.get(source, source)
    if name in SHIPPED:
        return read_config(name)[0], None
    if Path(source).expanduser().is_file() and source.endswith(".json"):  # a bare config.json: enough for dummy weights
        return read_config(Path(source).expanduser())[0], None
    folder = Path(resolve_source(source, field=field)).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(field, source, "a local checkpoint folder with config.json, or a model whose config ships with "
                          f"kimi-k3-serve ({', '.join(sorted(SHIPPED_MODEL_IDS))}): the rehearsal reads no model hub")
    return read_config(folder)[0], folder


def write_model_config(folder: Path, config: dict[str, Any]) -> Path:
    """``folder/config.json``: a model vLLM loads with dummy weights. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def materialize_models(args: ServeArgs, work: Path, layers: int | None):
    """Write the target's (and draft's) config.json where vLLM can load them with dummy weights, sliced to ``layers``
    layers when asked. Returns (args with those folders as sources, target folder, draft folder or None)."""
    from kimi_k3_serve.rehearsal.slicing import slice_draft_config, slice_text_config

    target, target_dir = _model_config(args.model.source, "args.model.source")
    draft = draft_dir = None
    if args.speculative is not None:
        draft, draft_dir = _model_config(args.speculative.model, "args.speculative.model")
    if layers is not None:
        target = slice_text_config(target, layers)
        target_dir = None
        if draft is not None:
            draft = slice_draft_config(draft, layers)
            draft_dir = None
    if target_dir is None:
        target_dir = write_model_config(work / "target", target)
    update: dict[str, Any] = {"model": args.model.model_copy(update={"source": str(target_dir)})}
    if draft is not None:
        if draft_dir is None:
            draft_dir = write_model_config(work / "draft", draft)
        update["speculative"] = args.speculative.model_copy(update={"model": str(draft_dir)})
    return args.model_copy(update=update), target_dir, draft_dir


def _stage_of_layout(real: ServeArgs, stage: int, flag: str):
    """The ``RankOf`` of ``stage`` of ``real``'s TP x PP layout (the layout's TP), or ConfigError naming ``flag``."""
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.layout import Layout
    from kimi_k3_serve.planning.memory import stage_layer_ranges
    from kimi_k3_serve.rehearsal.rank_slice import RankOf

    model, _, pins = planner_inputs(with_dummy_weights(real))
    if model.family != "kimi_k3":
        raise ConfigError(flag, stage, f"a Kimi-K3 deployment (the model is {model.architecture})")
    if pins.ep or pins.dp > 1:
        raise ConfigError(flag, stage, "a TP x PP layout: a rank of expert or data parallelism sees other "
                          "ranks' tokens, which one GPU cannot")
    stages = stage_layer_ranges(model.num_layers, Layout(tp=pins.tp, pp=pins.pp, layer_partition=pins.layer_partition))
    if stage >= len(stages):
        raise ConfigError(flag, stage, f"a stage of the layout: 0 to {len(stages) - 1}")
    start, end = stages[stage]
    return RankOf(stage, len(stages), start, end, pins.tp)


def _stage_model(real: ServeArgs, work: Path, rank, shapes, tp: int):
    """Write the stage ``rank`` names at the shapes ``shapes`` gives (one rank's, or the whole width) and return
    (the args that rehearse it at TP ``tp``, PP 1, target folder, draft folder or None)."""
    from kimi_k3_serve.rehearsal.rank_slice import rank_draft_config, rank_text_config

    target = rank_text_config(_model_config(real.model.source, "args.model.source")[0], shapes)
    target_dir = write_model_config(work / "target", target)
    parallel = real.parallel.model_copy(update={"tensor_parallel_size": tp, "pipeline_parallel_size": 1,
                                                "data_parallel_size": 1, "enable_expert_parallel": False,
                                                "layer_partition": None})
    update: dict[str, Any] = {"model": real.model.model_copy(update={"source": str(target_dir)}), "parallel": parallel,
                              "speculative": None}
    draft_dir = None
    if real.speculative is not None and rank.is_last:
        draft = rank_draft_config(_model_config(real.speculative.model, "args.speculative.model")[0], shapes)
        draft_dir = write_model_config(work / "draft", draft)
        update["speculative"] = real.speculative.model_copy(update={"model": str(draft_dir)})
    return real.model_copy(update=update), target_dir, draft_dir


def materialize_rank_slice(real: ServeArgs, work: Path, stage: int):
    """Write the rank slice of ``stage`` of ``real``'s layout (target, and the draft on the last stage) and return
    (the TP1 args that rehearse it, target folder, draft folder or None, the ``RankOf``)."""
    rank = _stage_of_layout(real, stage, "--rank-of")
    return (*_stage_model(real, work, rank, rank, tp=1), rank)


def materialize_stage(real: ServeArgs, work: Path, stage: int):
    """Write ``stage`` of ``real``'s layout as a model of its own, at full width: its layers in their order, the draft
    on the last stage, and, unlike the stage in the real engine, both vocabulary tables. Returns (the args that
    rehearse it at the layout's TP and PP 1, on one node's GPUs, target folder, draft folder or None, the
    ``RankOf``)."""
    from dataclasses import replace

    rank = _stage_of_layout(real, stage, "--stage-of")
    return (*_stage_model(real, work, rank, replace(rank, tp=1), tp=rank.tp), rank)


def rank_section(real_report, slice_report, rank, measured_kv: int | None, whole_stage: bool = False) -> dict[str, Any]:
    """The real rank's plan beside its rehearsed model's (the rank slice, or with ``whole_stage`` the stage at its TP):
    the terms the rehearsal cannot show and the real rank's KV pool as the plan gives it and as vLLM's measurement of
    the rehearsal implies it."""
    from kimi_k3_serve.rehearsal.rank_slice import rank_only_terms, real_rank_kv_bytes

    real = next(r for r in real_report.ranks if r.pp_stage == rank.stage)
    sliced = slice_report.ranks[0]
    terms = rank_only_terms(real, sliced, outside_real=real.total_bytes - real.budget_bytes - real.headroom_bytes,
                            outside_sliced=sliced.total_bytes - sliced.budget_bytes - sliced.headroom_bytes,
                            whole_stage=whole_stage)
    return {"stage": rank.stage, "num_stages": rank.num_stages, "layers": [rank.start, rank.end], "tp": rank.tp,
            "describe": rank.describe_stage() if whole_stage else rank.describe(), "real_verdict": real_report.verdict,
            "real_max_concurrency": real_report.max_concurrency, "real_rank": real.to_json(),
            "terms": [t.to_json() for t in terms], "real_kv_plan_bytes": real.kv_cache_bytes,
            "real_kv_from_vllm_bytes": None if measured_kv is None else real_rank_kv_bytes(measured_kv, terms)}


def render_rank_section(section: dict[str, Any]) -> str:
    from kimi_k3_serve.units import GiB

    lines = [f"the real rank: {section['describe']}; the plan of the whole layout says {section['real_verdict']} "
             f"({section['real_max_concurrency']:.2f} requests of max_model_len at once)",
             "  what the rehearsal cannot show (real rank minus the rehearsed model's, GiB):"]
    for t in section["terms"]:
        size = "not counted" if t["delta_bytes"] is None else f"{t['delta_bytes'] / GiB:+.2f}"
        lines.append(f"    {t['name']:<20} {size:>12}  {'exact' if t['exact'] else 'estimate'}: {t['source']}")
    implied = section["real_kv_from_vllm_bytes"]
    lines.append(f"  real rank's KV pool: plan {section['real_kv_plan_bytes'] / GiB:.2f} GiB"
                 + ("" if implied is None else f"; implied by vLLM's rehearsal {implied / GiB:.2f} GiB (its pool less "
                                               "the terms inside the budget)"))
    return "\n".join(lines)


def engine_of(args: ServeArgs, target_dir: Path, executor: str, resolved_tokens: int) -> tuple[dict[str, Any], dict[str, str]]:
    """(engine kwargs, env) as the application builder deploys them, for dummy weights. ``resolved_tokens`` is the
    plan's ``max_num_batched_tokens``, what a Serve replica's vLLM picks when the config leaves it unset."""
    from kimi_k3_serve.config.args_adapter import vllm_engine_args_of

    vllm = vllm_engine_args_of(with_dummy_weights(args))  # args' sources are the materialized folders
    kwargs = vllm.engine_kwargs
    if not any((target_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        kwargs["skip_tokenizer_init"] = True
    if "max_num_batched_tokens" not in kwargs:  # the Serve replica's vLLM sees no GPU: its fallback, not vllm.LLM's
        kwargs["max_num_batched_tokens"] = resolved_tokens
    kwargs["distributed_executor_backend"] = executor
    return kwargs, vllm.env_vars


def with_dummy_weights(args: ServeArgs) -> ServeArgs:
    """The args as a rehearsal runs them: ``load_format: dummy``, whatever the deploy config says."""
    return args.model_copy(update={"model": args.model.model_copy(update={"load_format": "dummy"})})


def predict(args: ServeArgs, device, inherited_env: Mapping[str, str] | None = None):
    """The plan's memory report for these args on ``device`` (a ``RankDevice``), with the dummy weights the
    rehearsal loads. ``inherited_env``: the environment the engine's workers inherit (this process's, on the host
    that runs them); its ``NCCL_*`` settings apply under the config's own, as they do for vLLM."""
    from dataclasses import replace

    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.layout import Layout
    from kimi_k3_serve.planning.memory import estimate_memory

    model, engine, pins = planner_inputs(with_dummy_weights(args))
    nccl = {k: v for k, v in (inherited_env or {}).items() if k.startswith("NCCL_")}
    if nccl:
        engine = replace(engine, env_vars={**nccl, **(engine.env_vars or {})})
    layout = Layout(tp=pins.tp, pp=pins.pp, ep=bool(pins.ep), dp=pins.dp, layer_partition=pins.layer_partition)
    return estimate_memory(model, layout, engine, device)


# -- the GPUs of this machine ---------------------------------------------------------------------------------------

def cluster_devices(world: int, gpu_type: str | None):
    """With Ray's executor the engine's workers run on the Ray cluster's GPUs, not necessarily this machine's: the plan
    uses the deploy config's GPU type (``args.accelerator.type``)."""
    from kimi_k3_serve.planning.hardware import lookup_gpu
    from kimi_k3_serve.planning.layout import RankDevice

    if gpu_type is None:
        raise ConfigError("args.accelerator.type", None, "a GPU type from the catalogue, for --executor ray")
    spec = lookup_gpu(gpu_type, field="args.accelerator.type")
    return RankDevice(spec.total_bytes, spec.compute_capability, name=spec.name), [f"rank {r}" for r in range(world)]


def local_devices(world: int, dry_run: bool):
    """(RankDevice for the plan, GPU labels) of the GPUs the engine will use; ConfigError without enough GPUs."""
    from kimi_k3_serve.cluster.nvml import local_gpus

    gpus, reason, _ = local_gpus()
    return choose_devices(visible_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")), reason, world, dry_run)


def choose_devices(gpus: list, reason: str | None, world: int, dry_run: bool):
    """The decision of ``local_devices`` on GPUs already read (``GpuInfo``, as CUDA will show them)."""
    from kimi_k3_serve.planning.hardware import find_gpu_by_device_name, lookup_gpu
    from kimi_k3_serve.planning.layout import RankDevice

    if not gpus and reason is None:
        reason = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU NVML sees"
    if not gpus:
        if dry_run:
            spec = lookup_gpu("H200")
            return RankDevice(spec.total_bytes, spec.compute_capability, name=spec.name), ["H200 (declared)"] * world
        raise ConfigError("rehearse", "no GPU here", f"a machine with an NVIDIA GPU ({reason})")
    if world > len(gpus):
        raise ConfigError("args.parallel", f"{world} GPUs (tensor x pipeline parallel)",
                          f"at most the {len(gpus)} GPU(s) of this machine; use --tp/--pp or --executor ray on a cluster")
    first = gpus[0]
    spec = find_gpu_by_device_name(first.name)
    total = first.total_bytes or (spec.total_bytes if spec else 0)
    cc = first.compute_capability or (spec.compute_capability if spec else (9, 0))
    device = RankDevice(total, cc, free_bytes=min(g.free_bytes or total for g in gpus[:world]), name=first.name)
    return device, [f"GPU {g.index}" for g in gpus[:world]]


def visible_gpus(gpus: list, cuda_visible_devices: str | None) -> list:
    """The GPUs CUDA will show the engine, in CUDA's order: NVML lists every GPU of the machine and ignores
    ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, as CUDA reads it: up to the first entry that names no GPU)."""
    if cuda_visible_devices is None:
        return list(gpus)
    out = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = next((g for g in gpus if entry == str(g.index) or (entry and g.uuid and g.uuid.startswith(entry))), None)
        if match is None:
            break
        out.append(match)
    return out


class PeakMemory:
    """NVML's used memory per GPU, sampled every 0.5 s while the engine runs; the peak of each."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "PeakMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:
            return
        while not self._stop.is_set():
            for i, h in enumerate(handles):
                try:
                    used = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
                except Exception:
                    continue
                self.peak[i] = max(self.peak.get(i, 0), used)
            self._stop.wait(0.5)


# -- the run --------------------------------------------------------------------------------------------------------

def engine_env(env: Mapping[str, str], work: Path) -> dict[str, str]:
    """The engine process's environment: this process's, the deploy config's over it, and the rehearsal's vLLM
    plugin on its path (``rehearsal/graph_samples.py``: vLLM logs only its CUDA-graph estimate's total, the plugin
    how it was built; ``rehearsal/profile_peak.py``: what the allocator charged at the profile's peak). Where
    ``VLLM_PLUGINS`` names the plugins vLLM may load, the plugin's entry points are named too: they only log."""
    from kimi_k3_serve.rehearsal import graph_samples

    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "VLLM_LOGGING_COLOR": "0"}
    plugin_path = str(graph_samples.install(work / "vllm-plugin"))
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (plugin_path, child_env.get("PYTHONPATH")) if p)
    if child_env.get("VLLM_PLUGINS"):
        child_env["VLLM_PLUGINS"] += "".join(f",{name}" for name in graph_samples.PLUGIN_NAMES)
    return child_env


def start_engine(spec: dict[str, Any], env: dict[str, str], work: Path, timeout: float, *, progress: bool) -> tuple[int, str, float]:
    """Run the engine process to its end; returns (exit code, its whole log, seconds)."""
    from kimi_k3_serve.rehearsal.vllm_log import STEPS, parse_vllm_log

    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = work / "vllm.log"
    child_env = engine_env(env, work)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        # Same process group as this command, so whoever stops it stops the engine's processes too.
        # vllm.LLM refuses DP > 1 in one process: dp_runner starts one process per DP rank
        runner = "dp_runner" if int(spec["engine_kwargs"].get("data_parallel_size", 1)) > 1 else "runner"
        proc = subprocess.Popen([sys.executable, "-m", f"kimi_k3_serve.rehearsal.{runner}", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env)
        shown = "start"
        seen = _Descendants(proc.pid)
        while proc.poll() is None:
            seen.update()
            if time.monotonic() - t0 > timeout:
                proc.kill()  # the engine's processes are stopped with the rest below
                print(f"rehearse: stopped after {timeout:.0f} s (--timeout)", file=sys.stderr, flush=True)
                break
            time.sleep(2)
            if progress:
                step = parse_vllm_log(log_path.read_text(errors="replace")).last_step
                if STEPS.index(step) > STEPS.index(shown):
                    shown = step
                    print(f"rehearse: {step} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        code = proc.wait()
    left = seen.kill_survivors()
    if left:
        print(f"rehearse: stopped {left} engine process(es) that outlived the run", file=sys.stderr, flush=True)
    return code, log_path.read_text(errors="replace"), time.monotonic() - t0


class _Descendants:
    """Every process the engine run started, as seen while it ran. A DP rank leaves with ``os._exit`` and its
    engine core and workers are orphaned, still holding the GPU (2 x H200, 2026-11-30: the next start found
    4.79 GiB free of 139.80); they are no longer the run's children when it ends, so they are remembered. A run
    stopped at ``--timeout`` has its engine processes stopped the same way."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._parent = psutil.Process(pid)
        self._seen: dict[int, Any] = {}

    def update(self) -> None:
        import psutil

        try:
            for child in self._parent.children(recursive=True):
                self._seen.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass

    def kill_survivors(self) -> int:
        import psutil

        alive = [p for p in self._seen.values() if p.is_running()]  # is_running also rules out a reused pid
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=30)
        return len(alive)


def _marker(text: str, name: str) -> dict[str, Any] | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return json.loads(line[len(name) + 1:])
    return None


def run(ns: argparse.Namespace) -> int:
    """With ``--work-dir``, the rehearsal's files go there; without, to a temp folder that is removed unless an
    engine ran (its log and result.json are printed as the place to look). An error about a value a flag set
    names that flag."""
    try:
        return _run_in_work_dir(ns)
    except ConfigError as exc:
        flag = _flag_of(exc.field, ns)
        if flag is None:
            raise
        raise ConfigError(flag, exc.value, exc.allowed) from None


def _run_in_work_dir(ns: argparse.Namespace) -> int:
    if ns.work_dir is not None:
        work = Path(ns.work_dir)
        try:
            work.mkdir(parents=True, exist_ok=True)
            tempfile.TemporaryFile(dir=work).close()  # a folder such as /proc/1 exists and cannot be written
        except OSError as exc:
            raise ConfigError("--work-dir", ns.work_dir, f"expected a folder that is or can be made, and written "
                                                         f"({exc.strerror})") from None
        return _run(ns, work)
    work, engine_ran = Path(tempfile.mkdtemp(prefix="kimi-k3-rehearse-")), False
    try:
        code = _run(ns, work)
        engine_ran = not ns.dry_run
        return code
    finally:
        if not engine_ran:
            shutil.rmtree(work, ignore_errors=True)


def _run(ns: argparse.Namespace, work: Path) -> int:
    from kimi_k3_serve.config.args_adapter import planner_inputs
    from kimi_k3_serve.planning.memory import resolved_batch
    from kimi_k3_serve.rehearsal.compare import compare, measured_verdict, render_table
    from kimi_k3_serve.rehearsal.runner import ENGINE_MARKER, FAILED_MARKER, GENERATED_MARKER
    from kimi_k3_serve.rehearsal.vllm_log import parse_vllm_log

    if ns.config is None and ns.model is None:
        ns.model = "moonshotai/Kimi-K3"
    args = serve_args_of(ns)
    if ns.rank_of is not None and ns.stage_of is not None:
        raise ConfigError("--stage-of", ns.stage_of, "no --stage-of with --rank-of: one rehearses a rank, the other "
                          "a whole stage")
    for flag, given in (("--rank-of", ns.rank_of), ("--stage-of", ns.stage_of)):
        if given is not None and ns.layers is not None:
            raise ConfigError("--layers", ns.layers, f"no --layers with {flag}: it rehearses its stage's depth")
    real_args = rank = None
    if ns.rank_of is not None:
        real_args = args
        args, target_dir, draft_dir, rank = materialize_rank_slice(real_args, work, ns.rank_of)
    elif ns.stage_of is not None:
        real_args = args
        args, target_dir, draft_dir, rank = materialize_stage(real_args, work, ns.stage_of)
    else:
        args, target_dir, draft_dir = materialize_models(args, work, ns.layers)
    if ns.executor == "ray":
        device, labels = cluster_devices(args.parallel.world_size, args.accelerator.type)
    else:
        device, labels = local_devices(args.parallel.world_size, ns.dry_run)
    refusal: ConfigError | None = None
    try:
        # mp: the workers are this process's children and inherit its NCCL settings; ray: the raylets' (unknown here).
        report = predict(args, device, inherited_env=os.environ if ns.executor == "mp" else None)
    except ConfigError as exc:
        if not ns.start_anyway:
            raise
        # The plan refuses; vLLM is started all the same, and its verdict is set beside "refused".
        report, refusal = None, exc
    if report is not None:
        tokens = report.max_num_batched_tokens
        plan = {"verdict": report.verdict, "fits": report.fits,
                "safe_gpu_memory_utilization": report.safe_gpu_memory_utilization,
                "max_concurrency": report.max_concurrency, "notes": list(report.notes)}
    else:
        tokens = resolved_batch(planner_inputs(args)[1], device)[0]
        plan = {"verdict": "refused", "fits": False, "refusal": str(refusal)}
    kwargs, env = engine_of(args, target_dir, ns.executor, tokens)
    result: dict[str, Any] = {"engine_kwargs": kwargs, "env": env, "work_dir": str(work), "gpus": labels, "plan": plan}
    # The real rank runs on the deploy's cluster, with the config's environment, not this host's.
    real_report = predict(real_args, device) if real_args is not None else None
    whole_stage = ns.stage_of is not None
    section_key = "stage_of" if whole_stage else "rank_of"
    if ns.dry_run:
        if report is not None:
            plan["ranks"] = [r.to_json() for r in report.ranks]
        said = (f"plan: {report.verdict} on {len(labels)} GPU(s)" if report is not None else f"the plan refuses: {refusal}")
        if real_report is not None and report is not None:
            result[section_key] = rank_section(real_report, report, rank, None, whole_stage)
            said += "\n" + render_rank_section(result[section_key])
        print(json.dumps(result, indent=1) if ns.json else
              f"would start vLLM with {json.dumps(kwargs)}\nenv {json.dumps(env)}\n{said}")
        return EXIT_STARTED
    spec = {"model": str(target_dir), "engine_kwargs": kwargs}
    with PeakMemory() as peak:
        code, log, seconds = start_engine(spec, env, work, ns.timeout, progress=not ns.json)
    reading = parse_vllm_log(log, device_total_bytes=device.total_bytes)
    if report is not None:
        comparison = compare(report, reading)
        comparison_json = comparison.to_json()
    else:
        measured = measured_verdict(reading)
        comparison_json = {"predicted_verdict": "refused", "measured_verdict": measured,
                           "verdicts_agree": measured == "refused", "ranks": []}
    engine = _marker(log, ENGINE_MARKER)
    generated = _marker(log, GENERATED_MARKER)
    failure = _marker(log, FAILED_MARKER)
    ok = code == 0 and generated is not None
    result.update(started=ok, exit_code=code, seconds=round(seconds, 1), engine=engine, generated=generated,
                  failure=failure, reading=reading.to_json(), comparison=comparison_json,
                  nvml_peak_used_bytes={str(k): v for k, v in sorted(peak.peak.items())}, log=str(work / "vllm.log"))
    if real_report is not None and report is not None:
        worker = reading.workers[0] if len(reading.workers) == 1 else reading.worker_of_rank(0)
        result[section_key] = rank_section(real_report, report, rank, worker.available_kv_bytes if worker else None,
                                           whole_stage)
    (work / "result.json").write_text(json.dumps(result, indent=1))
    if ns.json:
        print(json.dumps(result, indent=1))
    elif report is None:
        print(f"the plan refuses: {refusal}\nvLLM: {comparison_json['measured_verdict']}"
              + (f" ({reading.errors[-1][-300:]})" if reading.errors else ""))
    else:
        print(render_table(comparison, labels))
        if generated:
            print(f"generated {generated['tokens']} tokens for {generated['requests']} requests; engine up in "
                  f"{reading.init_seconds or 0:.0f} s ({seconds:.0f} s in all)")
        if failure:
            print(f"vLLM failed: {failure['type']}: {failure['message'][-300:]}")
        if section_key in result:
            print(render_rank_section(result[section_key]))
    if not ns.json:
        print(f"vLLM log: {work / 'vllm.log'}")
    if report is None:  # --start-anyway: 0 when vLLM refuses too (the plan was right), 1 when its refusal is to be looked at
        return EXIT_STARTED if comparison_json["verdicts_agree"] else EXIT_FAILED
    return EXIT_STARTED if ok else EXIT_FAILED

