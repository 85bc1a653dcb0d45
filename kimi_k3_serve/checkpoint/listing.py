"""Read a checkpoint's file list, sizes and ``model.safetensors.index.json`` without downloading its weights.

Three sources, one result (``planning.checkpoint.CheckpointListing``):

- a local or NFS folder, and ``s3://`` / ``gs://`` buckets: through a ``pyarrow.fs`` file system -- for buckets the
  one Ray Serve LLM's cloud mirrors use (``ray.llm._internal.common.utils.cloud_filesystem.PyArrowFileSystem
  .get_fs_and_path``: its credentials, ``AWS_ENDPOINT_URL_S3``, ``s3://anonymous@bucket`` rule), for folders
  ``pyarrow.fs.LocalFileSystem``; the same walk reads both;
- a Hugging Face hub id (``org/name``): ``HfApi.model_info(files_metadata=True)`` for every file's size and the
  SHA-256 of its LFS object, and ``hf_hub_download`` of the index alone.

Bad input (a URI of another scheme, a folder that does not exist, a missing or malformed index, an index naming
a file the checkpoint lacks) is one ``ConfigError`` naming the field.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path
from typing import Any

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.planning.checkpoint import INDEX_NAME, CheckpointFile, CheckpointListing

MAX_INDEX_BYTES = 256 * 2**20
"""Kimi-K3's index names 497,220 tensors (about 40 MB); anything past this is not an index."""
CLOUD_SCHEMES = ("s3://", "gs://")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SKIP_DIRS = (".cache", ".git", ".huggingface")


def source_scheme(source: str) -> str:
    """``cloud``, ``local`` or ``hub`` for a checkpoint source (``ConfigError`` for a URI of another scheme)."""
    if source.startswith(CLOUD_SCHEMES):
        return "cloud"
    if "://" in source:
        raise ConfigError("source", source, "expected a local folder, a hub id (org/name), s3://BUCKET/PATH or "
                                            "gs://BUCKET/PATH")
    if source.startswith((".", "/", "~")) or Path(source).expanduser().exists():
        return "local"
    if _HUB_ID.match(source):
        return "hub"
    raise ConfigError("source", source, "expected a local folder that exists, a hub id (org/name), s3:// or gs://")


def read_listing(source: str, *, field: str = "args.model.source", revision: str | None = None,
                 endpoint: str | None = None) -> CheckpointListing:
    """The listing of ``source`` (a folder, ``s3://``/``gs://`` URI or hub id). ``endpoint``: another hub (tests)."""
    try:
        scheme = source_scheme(source)
    except ConfigError as exc:
        raise ConfigError(field, source, exc.allowed) from None
    if scheme == "hub":
        return _hub_listing(source, field=field, revision=revision, endpoint=endpoint)
    fs, root = filesystem_of(source, field=field)
    return listing_from_fs(fs, root, source=source, field=field)


def filesystem_of(source: str, *, field: str) -> tuple[Any, str]:
    """(``pyarrow.fs`` file system, root path) of a folder or bucket URI."""
    import pyarrow.fs as pa_fs

    if source.startswith(CLOUD_SCHEMES):
        from ray.llm._internal.common.utils.cloud_filesystem import PyArrowFileSystem

        try:
            fs, root = PyArrowFileSystem.get_fs_and_path(source)
        except (ValueError, OSError) as exc:
            raise ConfigError(field, source, f"a bucket Ray Serve LLM's storage can open ({exc})") from None
        return fs, root.rstrip("/")
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise ConfigError(field, source, "expected a checkpoint folder that exists (it is "
                                         + ("a file)" if folder.exists() else "not there)"))
    return pa_fs.LocalFileSystem(), str(folder.resolve())


def listing_from_fs(fs: Any, root: str, *, source: str, field: str) -> CheckpointListing:
    """Walk ``root`` on ``fs`` (any ``pyarrow.fs.FileSystem``): every file's size, and the index if there is one."""
    import pyarrow.fs as pa_fs

    try:
        infos = fs.get_file_info(pa_fs.FileSelector(root, recursive=True, allow_not_found=False))
    except (FileNotFoundError, OSError) as exc:
        raise ConfigError(field, source, f"a checkpoint folder or bucket prefix that can be listed ({exc})") from None
    sizes: dict[str, int] = {}
    for info in infos:
        if info.type != pa_fs.FileType.File:
            continue
        rel = posixpath.relpath(info.path, root) if info.path.startswith(root) else info.base_name
        if rel.split("/")[0] in _SKIP_DIRS or posixpath.basename(rel).startswith("."):
            continue
        sizes[rel] = int(info.size)
    index = None
    if INDEX_NAME in sizes:
        if sizes[INDEX_NAME] > MAX_INDEX_BYTES:
            raise ConfigError(field, source, f"an {INDEX_NAME} of at most {MAX_INDEX_BYTES:,} bytes")
        with fs.open_input_stream(posixpath.join(root, INDEX_NAME)) as stream:
            index = stream.read(MAX_INDEX_BYTES + 1)
    return build_listing(source, sizes, {}, index, field=field)


def build_listing(source: str, sizes: dict[str, int], hashes: dict[str, str], index: bytes | None, *,
                  field: str) -> CheckpointListing:
    """The listing from file sizes, SHA-256s and the index's bytes (None: no index), checked against each other."""
    weights = sorted(name for name in sizes if name.endswith(".safetensors"))
    if not weights:
        raise ConfigError(field, source, "a safetensors checkpoint (found no *.safetensors file)")
    tensors_of: dict[str, list[str]] = {}
    if index is None:
        if len(weights) > 1:
            raise ConfigError(field, source, f"an {INDEX_NAME} beside its {len(weights)} safetensors files "
                                             "(vLLM needs it to tell the shards apart)")
    else:
        for tensor, name in parse_index(index, field=f"{field} ({INDEX_NAME})", source=source).items():
            if name not in sizes:
                raise ConfigError(f"{field} ({INDEX_NAME})", name, f"a file of the checkpoint: the index puts "
                                  f"{tensor} there, but {source} has no such file")
            tensors_of.setdefault(name, []).append(tensor)
    files = tuple(CheckpointFile(name, size, hashes.get(name), tuple(tensors_of.get(name, ())))
                  for name, size in sorted(sizes.items()))
    return CheckpointListing(source, files, has_index=index is not None)


def parse_index(data: bytes, *, field: str, source: str) -> dict[str, str]:
    """The ``weight_map`` of an index: tensor name -> file name (relative, no ``..``)."""
    if len(data) > MAX_INDEX_BYTES:
        raise ConfigError(field, source, f"an index of at most {MAX_INDEX_BYTES:,} bytes")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ConfigError(field, source, f"valid JSON ({str(exc).splitlines()[0][:100]})") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(field, source, "an object with a non-empty `weight_map` of tensor name -> file name")
    for tensor, name in weight_map.items():
        if not isinstance(name, str) or not name.endswith(".safetensors") or name.startswith("/") or ".." in name.split("/"):
            raise ConfigError(f"{field}.weight_map.{tensor}", name, "a relative *.safetensors file name")
    return weight_map


def _hub_listing(repo_id: str, *, field: str, revision: str | None, endpoint: str | None) -> CheckpointListing:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    api = HfApi(endpoint=endpoint)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ConfigError(field, repo_id, f"a model repository the hub has ({type(exc).__name__})") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ConfigError(field, repo_id, f"a hub the machine reaches ({str(exc).splitlines()[0][:160]})") from None
    sizes, hashes = {}, {}
    for sibling in info.siblings or ():
        lfs = sibling.lfs
        size = sibling.size if sibling.size is not None else (lfs.size if lfs else None)
        if size is None:
            continue
        sizes[sibling.rfilename] = int(size)
        if lfs is not None and lfs.sha256:
            hashes[sibling.rfilename] = lfs.sha256
    index = None
    if INDEX_NAME in sizes:
        try:
            path = hf_hub_download(repo_id, INDEX_NAME, revision=info.sha or revision, endpoint=endpoint)
        except (EntryNotFoundError, HfHubHTTPError, OSError) as exc:
            raise ConfigError(field, repo_id, f"a readable {INDEX_NAME} ({str(exc).splitlines()[0][:160]})") from None
        index = Path(path).read_bytes()
    listing = build_listing(repo_id, sizes, hashes, index, field=field)
    return listing
