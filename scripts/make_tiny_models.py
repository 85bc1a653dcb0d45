"""Make the tiny random-weight models the CPU default serves: a Llama target and its EAGLE3 draft.

No model hub is needed: the BPE tokenizer is trained on the spot on a small built-in text and the weights are
drawn from a fixed seed, so every run writes the same bytes. The models land in a cache folder
(``$KIMI_K3_SERVE_MODEL_CACHE``, default ``.cache/tiny-models`` under the repository) and are skipped when a
valid copy is already there (a manifest records the SHA-256 of every file).

    python scripts/make_tiny_models.py [--out DIR] [--force]

Importable by tests: ``ensure_tiny_models(cache_dir) -> TinyModels``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TARGET_NAME = "tiny-llama"
DRAFT_NAME = "tiny-llama-eagle3"
MODEL_CACHE_ENV = "KIMI_K3_SERVE_MODEL_CACHE"
MANIFEST = "kimi-k3-serve-manifest.json"
# Bump when the recipe below changes, so cached copies made by an older recipe are rebuilt.
RECIPE_VERSION = 1
SEED = 20261129

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 256
TARGET_LAYERS = 4
MAX_POSITIONS = 2048
VOCAB_TARGET = 384
RMS_EPS = 1e-5
# vLLM's default EAGLE3 tap layers are (2, n // 2, n - 3): for n = 4 they collide and the draft's fc input
# shape no longer matches, so the draft names three distinct layers of the target explicitly.
EAGLE_TAP_LAYERS = [0, 1, 2]

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model serves as a stand-in for a large one.
Ray Serve routes each request to a replica; vLLM schedules the tokens and keeps the cache in pages.
Pipeline parallelism splits the layers into stages, tensor parallelism splits each layer across devices.
A speculative draft proposes a few tokens, the target checks them in one step and keeps the ones it agrees with.
Hello! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.
Once upon a time there was a tiny language model that knew only a few hundred tokens.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048. Colours: red, green, blue, yellow.
The user asks a question and the assistant answers it, one token after another, until it stops.
"""


@dataclass(frozen=True)
class TinyModels:
    target: Path
    draft: Path


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_cache_dir() -> Path:
    configured = os.environ.get(MODEL_CACHE_ENV)
    return Path(configured) if configured else repo_root() / ".cache" / "tiny-models"


def ensure_tiny_models(cache_dir: Path | str | None = None, *, force: bool = False) -> TinyModels:
    """Return the paths of the tiny target and draft under ``cache_dir``, making them if missing or invalid."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    models = TinyModels(target=cache / TARGET_NAME, draft=cache / DRAFT_NAME)
    if not force and is_valid(models.target) and is_valid(models.draft):
        return models
    # Build both in a scratch folder next to the cache, then move them in: a crash never leaves half a model.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".making-") as scratch:
        scratch_dir = Path(scratch)
        tokenizer_files = _write_tokenizer(scratch_dir / TARGET_NAME)
        vocab_size = json.loads(tokenizer_files.read_text())["vocab_size_used"]
        (scratch_dir / TARGET_NAME / tokenizer_files.name).unlink()
        _write_target(scratch_dir / TARGET_NAME, vocab_size)
        _write_draft(scratch_dir / DRAFT_NAME, vocab_size)
        for name in (TARGET_NAME, DRAFT_NAME):
            _write_manifest(scratch_dir / name)
            final = cache / name
            if final.exists():
                shutil.rmtree(final)
            os.replace(scratch_dir / name, final)
    return models


def is_valid(model_dir: Path) -> bool:
    """True when ``model_dir`` holds every file its manifest lists, with the recorded hashes."""
    manifest_path = model_dir / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("recipe_version") != RECIPE_VERSION:
        return False
    files = manifest.get("files", {})
    return bool(files) and all(
        (model_dir / name).is_file() and _sha256(model_dir / name) == digest for name, digest in files.items()
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_manifest(model_dir: Path) -> None:
    files = {p.name: _sha256(p) for p in sorted(model_dir.iterdir()) if p.is_file() and p.name != MANIFEST}
    manifest = {"recipe_version": RECIPE_VERSION, "seed": SEED, "files": files}
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(model_dir: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    model_dir.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_TARGET,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (model_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n"
    )
    info = model_dir / "vocab-info.json"
    info.write_text(json.dumps({"vocab_size_used": tokenizer.get_vocab_size()}))
    return info


def _token_ids(model_dir: Path) -> dict[str, int]:
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return {token: vocab[token] for token in (BOS, EOS, PAD)}


def _llama_config(vocab_size: int, layers: int, **extra: object) -> dict[str, object]:
    return {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        **extra,
    }


def _attention_and_mlp(prefix: str, attn_in: int, draw) -> dict[str, object]:
    return {
        f"{prefix}.self_attn.q_proj.weight": draw(HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.k_proj.weight": draw(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.v_proj.weight": draw(KV_HEADS * HEAD_DIM, attn_in),
        f"{prefix}.self_attn.o_proj.weight": draw(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}.mlp.gate_proj.weight": draw(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": draw(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": draw(HIDDEN, INTERMEDIATE),
    }


def _drawer(seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    return draw


def _ones(n: int):
    import torch

    return torch.ones(n, dtype=torch.bfloat16)


def _write_target(model_dir: Path, vocab_size: int) -> None:
    from safetensors.torch import save_file

    ids = _token_ids(model_dir)
    config = _llama_config(
        vocab_size,
        TARGET_LAYERS,
        architectures=["LlamaForCausalLM"],
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    draw = _drawer(SEED)
    tensors: dict[str, object] = {"model.embed_tokens.weight": draw(vocab_size, HIDDEN)}
    for layer in range(TARGET_LAYERS):
        prefix = f"model.layers.{layer}"
        tensors.update(_attention_and_mlp(prefix, HIDDEN, draw))
        tensors[f"{prefix}.input_layernorm.weight"] = _ones(HIDDEN)
        tensors[f"{prefix}.post_attention_layernorm.weight"] = _ones(HIDDEN)
    tensors["model.norm.weight"] = _ones(HIDDEN)
    tensors["lm_head.weight"] = draw(vocab_size, HIDDEN)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def _write_draft(model_dir: Path, vocab_size: int) -> None:
    """EAGLE3 draft for vLLM's ``LlamaForCausalLMEagle3``: one mid layer whose attention reads 2H (the token
    embedding and the fused target hidden state), ``fc`` fusing the three tapped target layers, and no
    embedding of its own (it shares the target's). ``draft_vocab_size == vocab_size`` so no d2t table."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True)
    config = _llama_config(
        vocab_size,
        1,
        architectures=["LlamaForCausalLMEagle3"],
        draft_vocab_size=vocab_size,
        eagle_config={"eagle_aux_hidden_state_layer_ids": EAGLE_TAP_LAYERS, "use_aux_hidden_state": True},
    )
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    draw = _drawer(SEED + 1)
    tensors: dict[str, object] = _attention_and_mlp("midlayer", 2 * HIDDEN, draw)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"midlayer.{norm}.weight"] = _ones(HIDDEN)
    tensors["fc.weight"] = draw(HIDDEN, len(EAGLE_TAP_LAYERS) * HIDDEN)
    tensors["norm.weight"] = _ones(HIDDEN)
    tensors["lm_head.weight"] = draw(vocab_size, HIDDEN)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


SHARDED_INDEX = "model.safetensors.index.json"


def write_layer_shards(model_dir: Path | str, out_dir: Path | str) -> Path:
    """A copy of a tiny model (from ``ensure_tiny_models``) as several safetensors shards split by layer, with the
    index ``save_pretrained`` writes: ``model-00001-of-0000N.safetensors`` holds the embedding, one shard per
    decoder layer, the last one the final norm and ``lm_head``; the other files are copied as they are. Returns
    ``out_dir``. The tensors are the very bytes of ``model.safetensors``, so the copy serves the same outputs."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    source, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, dict[str, object]] = {}
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            key = f"layer{int(layer.group(1)):04d}" if layer else ("0first" if "embed_tokens" in name else "zlast")
            groups.setdefault(key, {})[name] = handle.get_tensor(name)
    keys = sorted(groups)
    weight_map, total = {}, 0
    for i, key in enumerate(keys):
        file_name = f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors"
        save_file(groups[key], str(out / file_name), metadata={"format": "pt"})
        total += (out / file_name).stat().st_size
        weight_map.update({name: file_name for name in groups[key]})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / SHARDED_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for path in source.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", MANIFEST):
            shutil.copyfile(path, out / path.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"cache folder (default: ${MODEL_CACHE_ENV} or .cache/tiny-models)")
    parser.add_argument("--force", action="store_true", help="rebuild even when a valid copy exists")
    args = parser.parse_args(argv)
    cache = args.out if args.out is not None else default_cache_dir()
    already = not args.force and is_valid(cache / TARGET_NAME) and is_valid(cache / DRAFT_NAME)
    start = time.perf_counter()
    models = ensure_tiny_models(cache, force=args.force)
    took = time.perf_counter() - start
    size = sum(p.stat().st_size for d in (models.target, models.draft) for p in d.iterdir())
    state = "already present" if already else f"made in {took:.2f} s"
    print(f"tiny models {state}: {models.target} and {models.draft} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
