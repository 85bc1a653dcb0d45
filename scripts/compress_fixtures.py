"""Store a recorded run's logs gzipped: every ``.log``, ``.txt``, ``.prom``, ``.out`` and ``.err`` file under the
folders named becomes ``NAME.gz``, byte for byte the same text. Run it after normalize_fixture_paths.py, on each run
copied in:

    python scripts/normalize_fixture_paths.py tests/fixtures/gpu/2026-12-06-round20
    python scripts/compress_fixtures.py tests/fixtures/gpu/2026-12-06-round20

Every call to a GPU host carries the whole working tree, the fixtures with it, and the tree's size sets how large a
part of the offline bundle one call can carry beside it (64 MiB in all): the logs, stored plain, were 9.6 MiB of the
tree's 18.7 MiB. Readers name the plain file (kimi_k3_serve/recorded.py).
"""

from __future__ import annotations

import argparse
import gzip
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kimi_k3_serve import recorded  # noqa: E402
from kimi_k3_serve.units import MiB  # noqa: E402


class StoredDiffers(Exception):
    """A log is there both plain and gzipped, with different text: a recorded log is never replaced."""


def plain_logs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in recorded.LOG_SUFFIXES)


def compress(path: Path) -> Path:
    """``path`` stored as ``path.gz``, the plain file removed. Where ``path.gz`` is there already, the plain file
    goes only if it holds the same text."""
    target = recorded.gzipped_path(path)
    data = path.read_bytes()
    if target.exists():
        if gzip.decompress(target.read_bytes()) != data:
            raise StoredDiffers(f"{path}: {target.name} is there with other text; keep one of them")
    else:
        target.write_bytes(recorded.gzipped(data))
    path.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.is_dir()]
    if missing:
        print(f"error: folders: {', '.join(missing)}: not a folder; name the folders of recorded runs",
              file=sys.stderr)
        return 2
    before = after = 0
    try:
        for folder in args.folders:
            for path in plain_logs(folder):
                before += path.stat().st_size
                after += compress(path).stat().st_size
    except StoredDiffers as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"compressed {before / MiB:.2f} MiB of logs to {after / MiB:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
