"""Make a servable Kimi-K3 slice for dummy-weight runs: ``kimi-k3-slice`` (the first N layers, every layer kind kept),
its DSpark and EAGLE3 (GQA and MLA) drafts, and a tokenizer that covers Kimi-K3's whole 163,840-token vocabulary.

No weights are written: the deploy config serves them with ``args.model.load_format: dummy``. The tokenizer is the
tiny models' BPE tokenizer (trained on the spot, scripts/make_tiny_models.py) padded with placeholder tokens up to
the model's vocabulary, so that any token id a random-weight model emits can be detokenized.

    python scripts/make_kimi_slice.py [--layers 4] [--out DIR]      # DIR: $KIMI_K3_SERVE_MODEL_CACHE or .cache/tiny-models
    python scripts/make_kimi_slice.py --only-config llama-3.1-8b=tests/fixtures/configs/llama-3.1-8b.json

``--only-config NAME=CONFIG`` makes folder NAME from any config.json the same way (config and padded tokenizer, no
weights), instead of the slice: e.g. Llama-3.1-8B for the serving benchmark (scripts/bench_serving.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import make_tiny_models  # noqa: E402

from kimi_k3_serve.models import read_config  # noqa: E402
from kimi_k3_serve.rehearsal.slicing import slice_draft_config, slice_text_config  # noqa: E402

TARGET_NAME = "kimi-k3-slice"
DSPARK_NAME = "kimi-k3-slice-dspark"
EAGLE3_NAME = "kimi-k3-slice-eagle3"
EAGLE3_MLA_NAME = "kimi-k3-slice-eagle3-mla"


def write_padded_tokenizer(out: Path, vocab_size: int) -> None:
    """The tiny BPE tokenizer with placeholder vocabulary entries ``<k3_N>`` for every id up to ``vocab_size``.

    They go into the BPE model's vocabulary (never produced by a merge, only decoded), not in as added tokens,
    which every tokenizer load would otherwise walk one by one."""
    from tokenizers import Tokenizer

    scratch = out.parent / (out.name + ".tokenizer-tmp")
    shutil.rmtree(scratch, ignore_errors=True)
    make_tiny_models._write_tokenizer(scratch)
    data = json.loads((scratch / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    have = max(max(vocab.values()), max(t["id"] for t in data.get("added_tokens", []))) + 1
    vocab.update({f"<k3_{i}>": i for i in range(have, vocab_size)})
    (out / "tokenizer.json").write_text(json.dumps(data))
    assert Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size() == vocab_size
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(scratch / name, out / name)
    shutil.rmtree(scratch)


def make_slice(cache: Path, layers: int, tokenizer: bool = True) -> list[Path]:
    """The slice and its drafts under ``cache``; ``tokenizer=False`` writes the configs only (all a plan reads)."""
    target = slice_text_config(read_config("kimi-k3")[0], layers)
    made = []
    for name, config in ((TARGET_NAME, target),
                         (DSPARK_NAME, slice_draft_config(read_config("kimi-k3-dspark")[0], layers)),
                         (EAGLE3_NAME, slice_draft_config(read_config("kimi-k3-eagle3")[0], layers)),
                         (EAGLE3_MLA_NAME, slice_draft_config(read_config("kimi-k3-eagle3-mla")[0], layers))):
        folder = cache / name
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        made.append(folder)
    if tokenizer:
        write_padded_tokenizer(cache / TARGET_NAME, target["vocab_size"])
    return made


def make_config_model(cache: Path, name: str, config_file: Path) -> Path:
    """Folder ``name`` under ``cache`` with ``config_file`` as its config.json and a tokenizer padded to its
    vocabulary: what a ``load_format: dummy`` deployment of that architecture needs."""
    config = json.loads(config_file.read_text())
    folder = cache / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    write_padded_tokenizer(folder, config["vocab_size"])
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="layers of the slice (at least 4: every layer kind)")
    parser.add_argument("--out", type=Path, default=None, help="model cache folder")
    parser.add_argument("--only-config", metavar="NAME=CONFIG", help="make folder NAME from CONFIG (a config.json) "
                        "instead of the slice")
    args = parser.parse_args(argv)
    cache = args.out if args.out is not None else make_tiny_models.default_cache_dir()
    start = time.perf_counter()
    if args.only_config:
        name, _, config_file = args.only_config.partition("=")
        if not name or not Path(config_file).is_file():
            parser.error(f"--only-config {args.only_config!r}: expected NAME=PATH of an existing config.json")
        folder = make_config_model(cache, name, Path(config_file))
        print(f"{name} (config and tokenizer, no weights) in {time.perf_counter() - start:.1f} s: {folder}")
        return 0
    try:
        made = make_slice(cache, args.layers)
    except Exception as exc:  # a bad --layers is a ConfigError naming the flag
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"Kimi-K3 slice of {args.layers} layers in {time.perf_counter() - start:.1f} s: {', '.join(map(str, made))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
