"""A recorded run's text files, stored plain or gzip-compressed.

Every run on a GPU is kept as a dated fixture, and every call to a GPU host carries the whole working tree, so the
fixtures' logs are stored gzipped (``vllm.log.gz``; scripts/compress_fixtures.py). A reader names a file as the run
wrote it (``vllm.log``) and gets its text either way.
"""

from __future__ import annotations

import gzip
import io
import os
from pathlib import Path

GZIP_SUFFIX = ".gz"


def stored_as(path: str | os.PathLike) -> Path:
    """The file that holds ``path``'s text: ``path`` itself, else ``path.gz``. When neither exists, ``path``, so a
    missing file is reported under the name the run wrote."""
    path = Path(path)
    if path.exists():
        return path
    compressed = path.with_name(path.name + GZIP_SUFFIX)
    return compressed if compressed.exists() else path


def exists(path: str | os.PathLike) -> bool:
    return stored_as(path).is_file()


def read_text(path: str | os.PathLike, *, errors: str = "strict", newline: str | None = None) -> str:
    stored = stored_as(path)
    if stored.name.endswith(GZIP_SUFFIX):
        with gzip.open(stored, "rt", encoding="utf-8", errors=errors, newline=newline) as handle:
            return handle.read()
    with open(stored, encoding="utf-8", errors=errors, newline=newline) as handle:
        return handle.read()


def gzipped(data: bytes) -> bytes:
    """``data`` gzipped with neither a name nor a time in the header: the same bytes each time it is stored."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=9, mtime=0) as out:
        out.write(data)
    return buffer.getvalue()


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path``, gzipped when its name ends in ``.gz``, line endings as given."""
    data = text.encode("utf-8")
    Path(path).write_bytes(gzipped(data) if str(path).endswith(GZIP_SUFFIX) else data)


def glob(folder: str | os.PathLike, pattern: str) -> list[Path]:
    """The files under ``folder`` that match ``pattern``, stored plain or gzipped, each named as the run wrote it."""
    folder = Path(folder)
    plain = {p for p in folder.glob(pattern) if not p.name.endswith(GZIP_SUFFIX)}
    compressed = {p.with_name(p.name[:-len(GZIP_SUFFIX)]) for p in folder.glob(pattern + GZIP_SUFFIX)}
    return sorted(plain | compressed)
