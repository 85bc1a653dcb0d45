"""Rewrite the machine paths in recorded fixtures: the checkout's own prefix goes (paths become relative to the
repository root), and a temp dir is written ``$TMPDIR/...``. A fixture then names nothing of the machine it was
recorded on beyond what the run itself chose (the GPU host's /var/tmp work folders, which run_all.sh takes from
``KIMI_K3_SERVE_GPU_RUNS`` and ``KIMI_K3_SERVE_MODEL_CACHE``).

    python scripts/normalize_fixture_paths.py tests/fixtures/gpu/2026-12-01-round3   # after copying a run in
    python scripts/normalize_fixture_paths.py --checkout /srv/ci/kimi-k3-serve FOLDER  # a run recorded elsewhere too

The device machine runs in a copy of the working tree at this checkout's own path, so this checkout's root is the
prefix by default.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
import zlib
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_k3_serve import recorded  # noqa: E402

CHECKOUTS = (str(ROOT),)
"""Where the checkouts that recorded the fixtures lived by default: this one (the GPU host's copy shares its path)."""
TEMP = re.compile(r"(?<![\w.-])/tmp/")
"""``/tmp/`` as a path of its own, not the tail of ``/var/tmp/``."""


def normalized(text: str, checkouts: tuple[str, ...] = CHECKOUTS) -> str:
    for checkout in checkouts:
        text = re.sub(re.escape(checkout) + r"(/|(?![\w.-]))", lambda m: "" if m.group(1) == "/" else ".", text)
    return TEMP.sub("$TMPDIR/", text)


def rewrites(folder: Path, checkouts: tuple[str, ...] = CHECKOUTS) -> Iterator[tuple[Path, str]]:
    """(file, its text normalized) for every text file under ``folder``, plain or gzipped, that names a machine
    path."""
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        if path.name.endswith(recorded.GZIP_SUFFIX) and not recorded.is_gzipped_log(path):
            continue  # an archive: nothing to rewrite
        try:  # progress bars keep their carriage returns
            text = recorded.read_text(path, newline="")
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError, zlib.error):
            continue  # images, and a log that is not whole: nothing to rewrite
        new = normalized(text, checkouts)
        if new != text:
            yield path, new


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--checkout", action="append", default=[],
                        help="another checkout's root the recorded paths may name (default: this checkout's only)")
    args = parser.parse_args(argv)
    checkouts = (*CHECKOUTS, *(c.rstrip("/") for c in args.checkout))
    changed = 0
    for folder in args.folders:
        for path, text in list(rewrites(folder, checkouts)):
            recorded.write_text(path, text)
            changed += 1
    print(f"{changed} file(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
