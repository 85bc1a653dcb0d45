"""What runs on one node: its download folder's free disk, the local copy ``prefetch`` wrote there, and the
download of that node's files (resumable, checked against size, the index and, where the source records one,
SHA-256). Plain functions of plain values, so a Ray task runs them on the node and a test runs them here.

A local copy is ``DIR/model`` (the target) and ``DIR/draft`` (the draft), each with the node's files, a
``model.safetensors.index.json`` naming only the tensors of the files it holds (vLLM 0.32 refuses an index that
names a missing file), and ``MANIFEST``: every stage's files and sizes, and which stages this node holds. A file
is written as ``NAME.part`` and renamed once checked, so a file with its final name is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

MANIFEST = "kimi-k3-serve-prefetch.json"
PART_SUFFIX = ".part"
CHUNK_BYTES = 8 * 2**20
HUB_PARTIAL_DIR = Path(".cache") / "huggingface" / "download"
"""Where ``hf_hub_download(local_dir=...)`` keeps a partial file (``NAME.incomplete``) that it resumes."""


def node_folder(download_dir: str | None) -> str:
    """The download folder as this node sees it: ``download_dir`` with ``$VAR`` and ``~`` expanded, else the
    Hugging Face hub cache, where vLLM and Ray Serve LLM download a hub model."""
    if download_dir:
        return os.path.expanduser(os.path.expandvars(download_dir))
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def free_bytes(folder: str, disk_usage: Callable[[str], Any] = shutil.disk_usage) -> int:
    """Free bytes of the file system ``folder`` is (or would be) on: its nearest existing ancestor's."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return int(disk_usage(str(path)).free)


def complete_bytes(folder: str, files: Mapping[str, int]) -> int:
    """Bytes of ``files`` (name -> size) already complete in ``folder`` (final name, right size), plus what their
    partial downloads hold: what a resumed download need not fetch again."""
    root = Path(folder)
    done = 0
    for name, size in files.items():
        final = root / name
        if final.is_file() and final.stat().st_size == size:
            done += size
            continue
        for part in (root / (name + PART_SUFFIX), root / HUB_PARTIAL_DIR / (name + ".incomplete")):
            if part.is_file():
                done += min(part.stat().st_size, size)
                break
    return done


def disk_report(folder: str, *, files: Mapping[str, int],
                disk_usage: Callable[[str], Any] = shutil.disk_usage) -> dict[str, Any]:
    """Free disk of ``folder`` and the bytes of ``files`` it already holds, as a Ray task returns them."""
    import socket

    return {"folder": folder, "free_bytes": free_bytes(folder, disk_usage),
            "present_bytes": complete_bytes(folder, files), "hostname": socket.gethostname()}


def missing_files(folder: str, stage_files: Mapping[str, Mapping[str, int]], stages: Sequence[int]) -> list[str]:
    """The files of ``stages`` (``stage_files``: stage -> file -> size) that ``folder`` lacks or holds at another size."""
    root = Path(folder)
    missing = []
    for stage in stages:
        for name, size in stage_files.get(str(stage), {}).items():
            path = root / name
            if not (path.is_file() and path.stat().st_size == size) and name not in missing:
                missing.append(name)
    return missing


def read_manifest(folder: str) -> dict[str, Any] | None:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def local_copy_report(download_dir: str) -> dict[str, Any]:
    """What the replica check reads on a node: the target copy's manifest and, per stage it lists, the files that
    are missing or the wrong size (a file removed or truncated since ``prefetch``)."""
    folder = os.path.join(node_folder(download_dir), "model")
    manifest = read_manifest(folder)
    if manifest is None:
        return {"folder": folder, "manifest": False, "stage_files": {}, "missing_by_stage": {}}
    stage_files = manifest.get("stage_files", {})
    draft_folder = os.path.join(node_folder(download_dir), "draft")
    draft = read_manifest(draft_folder)
    return {"folder": folder, "manifest": True, "stage_files": stage_files, "stages": list(manifest.get("stages", [])),
            "missing_by_stage": {stage: missing_files(folder, stage_files, [int(stage)]) for stage in stage_files},
            "draft_weights": bool(draft and draft.get("weights")),
            "draft_missing": missing_files(draft_folder, {"0": draft.get("files", {})}, [0]) if draft else []}


# ---------------------------------------------------------------------------------------------------------------
# The download of one node's files
# ---------------------------------------------------------------------------------------------------------------


class FetchError(Exception):
    """A file that could not be fetched or did not check out; the message names it."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def safetensors_names(path: Path) -> set[str]:
    """The tensor names a safetensors file's header lists."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name for name in header if name != "__metadata__"}


def _copy_range(read_at: Callable[[int, int], bytes], size: int, part: Path) -> None:
    """Append bytes ``[len(part), size)`` of a source to ``part`` (resumes where it stopped)."""
    offset = part.stat().st_size if part.exists() else 0
    if offset > size:
        part.unlink()
        offset = 0
    with open(part, "ab") as out:
        while offset < size:
            chunk = read_at(offset, min(CHUNK_BYTES, size - offset))
            if not chunk:
                raise FetchError(f"{part.name}: the source ended at byte {offset:,} of {size:,}")
            out.write(chunk)
            offset += len(chunk)


def fetch_file(source: str, entry: Mapping[str, Any], folder: Path, *, endpoint: str | None = None,
               revision: str | None = None) -> str:
    """Fetch one file of ``source`` into ``folder``; returns how it was checked. ``entry``: name, size, sha256,
    tensors (from the listing)."""
    name, size = entry["name"], int(entry["size"])
    final = folder / name
    final.parent.mkdir(parents=True, exist_ok=True)
    if source.startswith(("s3://", "gs://")) or not _is_hub(source):
        part = folder / (name + PART_SUFFIX)
        _copy_range(_reader(source, name), size, part)
        written = part
    else:
        from huggingface_hub import hf_hub_download

        written = Path(hf_hub_download(source, name, revision=revision, local_dir=str(folder), endpoint=endpoint))
    checks = _check(written, entry)
    if written != final:
        os.replace(written, final)
    return checks


def _check(path: Path, entry: Mapping[str, Any]) -> str:
    name, size = entry["name"], int(entry["size"])
    actual = path.stat().st_size
    if actual != size:
        path.unlink()
        raise FetchError(f"{name}: {actual:,} bytes, the listing says {size:,} (removed; run prefetch again)")
    checks = ["size"]
    if entry.get("sha256"):
        digest = sha256_of(path)
        if digest != entry["sha256"]:
            path.unlink()
            raise FetchError(f"{name}: SHA-256 {digest[:16]}..., the hub's LFS metadata says {entry['sha256'][:16]}... "
                             "(removed; run prefetch again)")
        checks.append("sha256")
    if entry.get("tensors") and name.endswith(".safetensors"):
        names = safetensors_names(path)
        wanted = set(entry["tensors"])
        if not wanted <= names:
            path.unlink()
            raise FetchError(f"{name}: lacks {len(wanted - names)} tensor(s) the index puts there, e.g. "
                             f"{sorted(wanted - names)[0]} (removed)")
        checks.append("index")
    return "+".join(checks)


def _is_hub(source: str) -> bool:
    return not (source.startswith((".", "/", "~")) or os.path.exists(os.path.expanduser(source)))


def _reader(source: str, name: str) -> Callable[[int, int], bytes]:
    """``read_at(offset, length)`` of one file of a folder or bucket, through the same file systems the listing uses."""
    from kimi_k3_serve.checkpoint.listing import filesystem_of

    fs, root = filesystem_of(source, field="source")
    handle = fs.open_input_file(f"{root}/{name}")
    return lambda offset, length: handle.read_at(length, offset)


def fetch_node(spec: Mapping[str, Any], report: Callable[[int, int, str], None] | None = None, *,
               disk_usage: Callable[[str], Any] = shutil.disk_usage, interval_s: float = 1.0) -> dict[str, Any]:
    """Fetch one node's files. ``spec``: ``folder`` (the download folder, expanded here), ``parts``: a list of
    ``{subdir, source, files: [entry], index, manifest}`` (target and draft). Refuses before any byte is written
    when the folder's disk cannot take what is missing. ``report(done_bytes, total_bytes, state)`` every
    ``interval_s`` while it runs, from a thread."""
    folder = Path(node_folder(spec["folder"]))
    parts = spec["parts"]
    sizes = {f"{p['subdir']}/{e['name']}": int(e["size"]) for p in parts for e in p["files"]}
    total = sum(sizes.values())
    present = complete_bytes(str(folder), sizes)
    free = free_bytes(str(folder), disk_usage)
    need = total - present
    if need > free:
        return {"ok": False, "folder": str(folder), "need_bytes": need, "free_bytes": free, "total_bytes": total,
                "refused": True}
    stop = threading.Event()

    def progress() -> None:
        while not stop.wait(interval_s):
            if report is not None:
                report(complete_bytes(str(folder), sizes), total, "downloading")

    watcher = threading.Thread(target=progress, daemon=True)
    watcher.start()
    checked: dict[str, str] = {}
    started = time.monotonic()
    try:
        for part in parts:
            sub = folder / part["subdir"]
            sub.mkdir(parents=True, exist_ok=True)
            for entry in part["files"]:
                final = sub / entry["name"]
                if final.is_file() and final.stat().st_size == int(entry["size"]):
                    checked[f"{part['subdir']}/{entry['name']}"] = "present"
                    continue
                checked[f"{part['subdir']}/{entry['name']}"] = fetch_file(
                    part["source"], entry, sub, endpoint=spec.get("endpoint"), revision=part.get("revision"))
            if part.get("index") is not None:
                (sub / "model.safetensors.index.json").write_text(json.dumps(part["index"], indent=1) + "\n")
            (sub / MANIFEST).write_text(json.dumps(part["manifest"], indent=1, sort_keys=True) + "\n")
    except (FetchError, OSError) as exc:
        return {"ok": False, "folder": str(folder), "error": str(exc), "total_bytes": total, "refused": False}
    finally:
        stop.set()
        watcher.join(timeout=interval_s + 1)
    if report is not None:
        report(total, total, "done")
    return {"ok": True, "folder": str(folder), "total_bytes": total, "fetched_bytes": need, "checked": checked,
            "seconds": time.monotonic() - started}
