"""``kimi-k3-serve memory``: per-GPU memory of one layout under vLLM 0.32's accounting, before launch.

Prints a per-stage table (GiB), the verdict with each short rank's shortfall, max concurrency, which
numbers are estimates (marked ``*``, with margins) and the time taken; ``--json`` prints the report as
JSON instead. Without ``--max-model-len`` the model config's length is used, capped at the longest that fits
this layout (the line ``max_model_len: ...`` says which and why). Exit code 0: fits; 1: does not fit; 2: bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from kimi_k3_serve.commands.argtypes import MAX_BATCHED_TOKENS, MAX_DP, MAX_LAYERS, MAX_NUM_SEQS, MAX_TP, fraction, int_from, positive_int
from kimi_k3_serve.commands.lengths import given, longest_that_fits, model_config_length
from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.inputs import load_json
from kimi_k3_serve.planning.hardware import gpu_names, lookup_gpu
from kimi_k3_serve.planning.layout import KV_CACHE_DTYPES, MAMBA_SSM_CACHE_DTYPES, EngineSettings, Layout, RankDevice, SpeculativeSettings
from kimi_k3_serve.units import GiB, fmt_gib

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 1


def _partition(text: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated layer counts such as 47,46") from None
    if not parts or any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected comma-separated positive layer counts")
    return parts


def _capability(text: str) -> tuple[int, int]:
    """MAJOR.MINOR of a GPU vLLM 0.32 runs on: SM 7.0 (Volta) to the 12.x of today's newest."""
    try:
        major, minor = (int(part) for part in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected MAJOR.MINOR such as 9.0") from None
    if not (7 <= major <= 12 and 0 <= minor <= 9):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected MAJOR.MINOR from 7.0 to 12.9, such as 9.0")
    return major, minor


EXAMPLES = """\
examples:
  kimi-k3-serve memory --gpu H200 --tp 8 --pp 2                           # longest max_model_len that fits
  kimi-k3-serve memory --gpu B200 --tp 8 --pp 2 --max-model-len 262144 --json
  kimi-k3-serve memory --gpu-bytes 150000000000 --tp 8 --pp 2 --max-model-len 32768

exit codes: 0 fits, 1 does not fit, 2 bad input
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EXAMPLES
    parser.add_argument("--model", default="kimi-k3",
                        help="kimi-k3 (shipped config), a config.json path or a checkpoint folder (default: kimi-k3)")
    gpu = parser.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--gpu", help=f"GPU type, one of: {', '.join(gpu_names())}")
    gpu.add_argument("--gpu-bytes", type=positive_int, help="usable bytes per GPU (torch total_memory)")
    parser.add_argument("--compute-capability", type=_capability, default=None,
                        help="with --gpu-bytes: the GPU's compute capability (default 9.0)")
    parser.add_argument("--tp", type=int_from(1, MAX_TP), default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int_from(1, MAX_LAYERS), default=1, help="pipeline parallel size")
    parser.add_argument("--ep", action=argparse.BooleanOptionalAction, default=False, help="enable expert parallelism")
    parser.add_argument("--dp", type=int_from(1, MAX_DP), default=1, help="data parallel size")
    parser.add_argument("--dcp", type=int_from(1, MAX_TP), default=1, help="decode context parallel size")
    parser.add_argument("--layer-partition", type=_partition, default=None, help="layers per PP stage, e.g. 47,46")
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="longest prompt plus output, in tokens (default: the model config's max_position_embeddings, "
                             "capped at the longest that fits this layout)")
    parser.add_argument("--max-num-seqs", type=int_from(1, MAX_NUM_SEQS), default=None, help="default: vLLM 0.32's for the GPU")
    parser.add_argument("--max-num-batched-tokens", type=int_from(1, MAX_BATCHED_TOKENS), default=None, help="default: vLLM 0.32's for the GPU")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=MAMBA_SSM_CACHE_DTYPES, default="auto")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.92)
    parser.add_argument("--speculative-config", default=None,
                        help='JSON, e.g. \'{"method": "dspark", "model": "kimi-k3-dspark", "num_speculative_tokens": 7}\'')
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on (vLLM 0.32's default for decoder and hybrid models)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--language-model-only", action=argparse.BooleanOptionalAction, default=True,
                        help="skip the vision tower (default: on)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _speculative(text: str | None, tp: int) -> SpeculativeSettings | None:
    if text is None:
        return None
    from kimi_k3_serve.models import load_model

    raw = load_json(text, "--speculative-config", text)
    if not isinstance(raw, dict):
        raise ConfigError("--speculative-config", text, "expected a JSON object")
    known = {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size"}
    method = raw.get("method")
    if method not in ("eagle3", "dspark"):
        raise ConfigError("--speculative-config.method", method, "expected eagle3 or dspark")
    model = raw.get("model", "kimi-k3-dspark" if method == "dspark" else None)
    if not isinstance(model, str) or not model.strip():
        raise ConfigError("--speculative-config.model", model, "expected the draft's config.json path or checkpoint "
                                                               "folder (a non-empty string)")
    try:
        draft = load_model(model)
    except ConfigError as exc:  # load_model names its argument "model": here it is the draft's
        raise ConfigError("--speculative-config.model", exc.value, exc.allowed) from None
    n = raw.get("num_speculative_tokens")
    if n is None and draft.draft is not None:
        n = draft.draft.num_speculative_tokens_default
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("--speculative-config.num_speculative_tokens", n, "expected an integer >= 1")
    extra = sorted(set(raw) - known - {"attention_backend", "draft_sample_method", "rejection_sample_method"})
    if extra:
        raise ConfigError(f"--speculative-config.{extra[0]}", raw[extra[0]], f"known keys: {', '.join(sorted(known))}")
    draft_tp = raw.get("draft_tensor_parallel_size")
    if draft_tp is not None and (isinstance(draft_tp, bool) or not isinstance(draft_tp, int)):
        raise ConfigError("--speculative-config.draft_tensor_parallel_size", draft_tp,
                          f"expected 1 or the target's TP ({tp})")
    return SpeculativeSettings(method, n, draft=draft, draft_tp=draft_tp)


_FLAG_OF_FIELD = {
    "layout.tp": "--tp", "layout.pp": "--pp", "layout.dp": "--dp", "layout.dcp": "--dcp",
    "layout.layer_partition": "--layer-partition", "layout.layer_partition[]": "--layer-partition",
    "engine.max_model_len": "--max-model-len", "engine.max_num_seqs": "--max-num-seqs",
    "engine.max_num_batched_tokens": "--max-num-batched-tokens", "engine.kv_cache_dtype": "--kv-cache-dtype",
    "engine.gpu_memory_utilization": "--gpu-memory-utilization", "engine.mamba_ssm_cache_dtype": "--mamba-ssm-cache-dtype",
    "model": "--model",
}


def run(args: argparse.Namespace) -> int:
    """Name the command-line flag in any error about a value that came from one."""
    try:
        return _run(args)
    except ConfigError as exc:
        flag = _FLAG_OF_FIELD.get(exc.field)
        if flag is None and exc.field.startswith("speculative."):
            flag = "--speculative-config." + exc.field.split(".", 1)[1]
        if flag is None:
            raise
        raise type(exc)(flag, exc.value, exc.allowed, source=exc.source) from None


def _run(args: argparse.Namespace) -> int:
    from kimi_k3_serve.planning.memory import estimate_memory
    from kimi_k3_serve.models import load_model

    t0 = time.perf_counter()
    model = load_model(args.model)
    if args.gpu is not None:
        spec = lookup_gpu(args.gpu, field="--gpu")
        if args.compute_capability not in (None, spec.compute_capability):
            asked, own = (".".join(map(str, cc)) for cc in (args.compute_capability, spec.compute_capability))
            raise ConfigError("--compute-capability", asked, f"only with --gpu-bytes: the {spec.name} is {own}")
        device = RankDevice(spec.total_bytes, spec.compute_capability, name=spec.name)
        gpu_label = spec.name
    else:
        device = RankDevice(args.gpu_bytes, args.compute_capability or (9, 0), name="")
        gpu_label = f"{fmt_gib(args.gpu_bytes)} GPU"
    layout = Layout(tp=args.tp, pp=args.pp, ep=args.ep, dp=args.dp, dcp=args.dcp, layer_partition=args.layer_partition)
    from kimi_k3_serve.planning.planner import tp_refusal, validate_length

    refusal = tp_refusal(model, args.tp)
    if refusal:
        raise ConfigError("layout.tp", args.tp, f"expected a size vLLM accepts for {model.name}: {refusal}")

    max_len = args.max_model_len or model_config_length(model)
    validate_length(model, max_len)
    engine = EngineSettings(
        max_model_len=max_len, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=args.enable_prefix_caching, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        speculative=_speculative(args.speculative_config, args.tp), language_model_only=args.language_model_only,
        enforce_eager=args.enforce_eager,
    )
    if args.max_model_len:
        choice = given(args.max_model_len)
    else:
        choice = longest_that_fits(max_len, lambda length: estimate_memory(
            model, layout, replace(engine, max_model_len=length), device).fits)
        engine = replace(engine, max_model_len=choice.value)
    t1 = time.perf_counter()
    report = estimate_memory(model, layout, engine, device)
    t2 = time.perf_counter()
    if args.json:
        out: dict[str, Any] = report.to_json()
        out["model"] = {"name": model.name, "architecture": model.architecture, "quantization": model.quantization,
                        "source": model.source}
        out["gpu"] = {"name": gpu_label, "total_bytes": device.total_bytes, "compute_capability": list(device.compute_capability)}
        out["max_model_len_choice"] = choice.to_json()
        out["elapsed_ms"] = {"estimate": round((t2 - t1) * 1e3, 3), "total": round((time.perf_counter() - t0) * 1e3, 3)}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(choice.line)
        print(render(report, model, gpu_label, device))
        print(f"computed in {(t2 - t1) * 1e3:.2f} ms (estimate) / {(time.perf_counter() - t0) * 1e3:.1f} ms (with config load)")
    return EXIT_FITS if report.fits else EXIT_DOES_NOT_FIT


def _g(n: int | float) -> str:
    return f"{n / GiB:,.2f}"


def render(report, model, gpu_label: str, device: RankDevice) -> str:
    lay, eng = report.layout, report.engine
    lines = [
        f"{model.name}: {model.architecture}, {model.quantization}",
        f"{lay.world_size} x {gpu_label} ({fmt_gib(device.total_bytes)} usable, SM{device.compute_capability[0]}{device.compute_capability[1]}), "
        f"{lay.describe()}",
        f"engine: max_model_len {eng.max_model_len:,}, max_num_seqs {report.max_num_seqs}, "
        f"max_num_batched_tokens {report.max_num_batched_tokens:,}, kv_cache_dtype {eng.kv_cache_dtype}, "
        f"prefix caching {'on' if report.enable_prefix_caching else 'off'}, gpu_memory_utilization {eng.gpu_memory_utilization}"
        + (f", {eng.speculative.method} x{eng.speculative.num_speculative_tokens}" if eng.speculative else ""),
        "",
        "per GPU (GiB; * = estimate)",
    ]
    header = ["stage", "ranks", "layers", "weights", "draft", "activ.*", "cudagraph*", "non-torch*", "workspace*",
              "budget", "KV pool", "blocks", "short"]
    rows = [header]
    for r in report.stage_ranks():
        start, end = report.stage_layers[r.pp_stage]
        kda = sum(1 for i in range(start, end) if model.layers[i].attention == "kda")
        ranks = [x.rank for x in report.ranks if x.pp_stage == r.pp_stage]
        span = f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
        layers = f"{start}-{end - 1}" + (f" ({kda} KDA/{end - start - kda} MLA)" if kda else "")
        rows.append([str(r.pp_stage), span, layers, _g(r.weights_bytes), _g(r.draft_bytes), _g(r.activation_bytes),
                     _g(r.cuda_graph_bytes), _g(r.non_torch_bytes), _g(r.workspace_bytes), _g(r.budget_bytes),
                     _g(r.kv_cache_bytes), f"{r.num_blocks:,}", _g(r.shortfall_bytes) if r.shortfall_bytes else "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        lines.append("  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    lines.append("")
    first = report.stage_ranks()
    lines.append(
        f"KV cache: block {report.block_size} tokens, {first[0].page_bytes:,} B page, bytes/block "
        + ", ".join(f"stage {r.pp_stage} {r.bytes_per_block:,} B" for r in first)
        + f"; {report.num_kv_groups} group(s) ({report.kv_grouping}); one request of {eng.max_model_len:,} tokens needs "
        f"{report.blocks_per_request:,} blocks"
    )
    if report.fits:
        lines.append(
            f"FITS: {report.num_blocks:,} blocks (min over ranks; binding rank {report.binding_rank}), "
            f"{report.kv_cache_tokens:,} tokens, max concurrency {report.max_concurrency:.2f}x at {eng.max_model_len:,} tokens "
            f"({report.banded_max_concurrency:.2f}x with every measured error band against it)"
        )
    elif report.verdict == "at_risk":
        lines.append(
            f"AT RISK: fits at the point estimates ({report.max_concurrency:.2f}x at {eng.max_model_len:,} tokens), not with "
            f"the measured error bands against it (up to {fmt_gib(report.kv_band_bytes)} of KV pool per GPU): "
            f"{report.banded_max_concurrency:.2f}x"
        )
    else:
        lines.append(f"DOES NOT FIT: largest shortfall {fmt_gib(report.shortfall_bytes)} (rank {report.binding_rank})")
        for r in report.ranks:
            if r.shortfall_bytes:
                why = []
                if r.free_bytes < r.budget_bytes:
                    why.append(f"free {fmt_gib(r.free_bytes)} < budget {fmt_gib(r.budget_bytes)}")
                if r.kv_cache_bytes <= 0:
                    why.append(f"non-KV memory exceeds the budget by {fmt_gib(-r.kv_cache_bytes)}")
                else:
                    why.append(f"KV pool {fmt_gib(r.kv_cache_bytes)} cannot hold one {eng.max_model_len:,}-token request")
                lines.append(f"  rank {r.rank} (stage {r.pp_stage}, tp {r.tp_rank}): short {fmt_gib(r.shortfall_bytes)}: {'; '.join(why)}")
    lines.append("")
    lines.append("estimates (stage: value +- margin):")
    for e in report.estimates:
        lines.append(f"  {e.name} (stage {e.stage}): {fmt_gib(e.bytes)} +- {fmt_gib(e.margin_bytes)}  [{e.basis}]")
    lines.append("optimisations:")
    for item in report.optimisations.items:
        env = " ".join(f"{k}={v}" for k, v in item.env)
        lines.append(f"  {item.name}: {'on' if item.on else 'off'} ({item.reason})" + (f"  env: {env}" if env else ""))
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
