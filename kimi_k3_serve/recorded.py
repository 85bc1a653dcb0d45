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
LOG_SUFFIXES = (".log", ".txt", ".prom", ".out", ".err")
"""What a run writes as text to read later, and what is stored gzipped: vLLM's and Serve's logs, py-spy's profiles,
Prometheus scrapes, stderr."""


def is_gzipped_log(path: str | os.PathLike) -> bool:
    """``NAME.gz`` where NAME is a log (``vllm.log.gz``), not any archive (``jit-cache.tar.gz``)."""
    name = Path(path).name
    return name.endswith(GZIP_SUFFIX) and Path(name[:-len(GZIP_SUFFIX)]).suffix in LOG_SUFFIXES


def gzipped_path(path: str | os.PathLike) -> Path:
    """Where ``path`` is stored gzipped: ``vllm.log`` -> ``vllm.log.gz``."""
    path = Path(path)
    return path.with_name(path.name + GZIP_SUFFIX)


def stored_as(path: str | os.PathLike) -> Path:
    """The file that holds ``path``'s text: ``path`` itself, else ``path.gz``. When neither exists, ``path``, so a
    missing file is reported under the name the run wrote."""
    path = Path(path)
    if path.exists():
        return path
    compressed = gzipped_path(path)
    return compressed if compressed.exists() else path


def exists(path: str | os.PathLike) -> bool:
    return stored_as(path).is_file()


def read_text(path: str | os.PathLike, *, errors: str = "strict", newline: str | None = None) -> str:
    stored = stored_as(path)
    if is_gzipped_log(stored):
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
    """Write ``text`` to ``path``, gzipped when it is a gzipped log's name, line endings as given."""
    data = text.encode("utf-8")
    Path(path).write_bytes(gzipped(data) if is_gzipped_log(path) else data)


def glob(folder: str | os.PathLike, pattern: str) -> list[Path]:
    """The files under ``folder`` that match ``pattern``, stored plain or gzipped, each named as the run wrote it."""
    folder = Path(folder)
    plain = {p for p in folder.glob(pattern) if not is_gzipped_log(p)}
    compressed = {p.with_name(p.name[:-len(GZIP_SUFFIX)]) for p in folder.glob(pattern + GZIP_SUFFIX)
                  if is_gzipped_log(p)}
    return sorted(plain | compressed)
