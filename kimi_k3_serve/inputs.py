"""Reading the files a user points us at, with bounds: only regular files, at most ``MAX_FILE_BYTES``, UTF-8, and
YAML/JSON documents whose size is bounded before anything walks them.

Every problem is a ``ConfigError`` naming the caller's field (``config``, ``cluster``, ``model``). Without these
bounds a FIFO blocks ``open`` until some writer appears, a YAML alias bomb expands to billions of nodes, and a
document nested a few thousand levels deep ends in a ``RecursionError`` from the composer or the validators.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
from typing import Any

from kimi_k3_serve.errors import ConfigError
from kimi_k3_serve.tokens import NotShown, looks_like_token

MAX_FILE_BYTES = 4 * 2**20
"""Deploy configs, cluster files and config.json files are a few KiB; the largest shipped one is ~50 KiB."""
MAX_DEPTH = 64
"""Mappings and lists nested in each other; the deepest real document (a KubeRay file) is about 15."""
MAX_NODES = 200_000
"""Scalars, mappings and lists once every alias is expanded: what the readers and validators will walk."""


def read_text_file(path: str | os.PathLike, field: str, *, what: str) -> str:
    """The UTF-8 text of a regular file. ``what`` says what was expected, e.g. "a Serve config YAML"."""
    shown = os.fspath(path)
    try:
        before = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(field, shown, f"expected {what}: no such file") from None
    except OSError as exc:
        raise ConfigError(field, shown, f"expected {what}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(before.st_mode):
        raise ConfigError(field, shown, f"expected {what}: a regular file, not {_kind(before.st_mode)}")
    try:
        # O_NONBLOCK: were the path swapped for a FIFO after the stat, open would still not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ConfigError(field, shown, f"expected {what}: cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        opened = os.fstat(handle.fileno())
        if not stat.S_ISREG(opened.st_mode):
            raise ConfigError(field, shown, f"expected {what}: a regular file, not {_kind(opened.st_mode)}")
        if opened.st_size > MAX_FILE_BYTES:
            raise ConfigError(field, shown, f"expected {what} of at most {MAX_FILE_BYTES:,} bytes "
                                            f"(this one has {opened.st_size:,})")
        try:
            data = handle.read(MAX_FILE_BYTES + 1)
        except OSError as exc:  # e.g. /proc/self/mem: a "regular file" of size 0 whose reads fail
            raise ConfigError(field, shown, f"expected {what}: cannot be read ({exc.strerror})") from None
    if len(data) > MAX_FILE_BYTES:  # grew since the fstat
        raise ConfigError(field, shown, f"expected {what} of at most {MAX_FILE_BYTES:,} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(field, shown, f"expected {what} in UTF-8 text (byte {exc.start} is not UTF-8)") from None


def refuse_token_text(text: str, field: str, *, source: str) -> None:
    """A ``ConfigError`` naming the first line of a file's text that holds something shaped like a token: in a
    comment or a key, where the field checks do not look, it would still be copied (``render`` carries a Serve config
    into a RayService verbatim) or printed (a cluster file's node names)."""
    for number, line in enumerate(text.splitlines(), start=1):
        if looks_like_token(line):
            raise ConfigError(field, NotShown(), f"expected no token in the file: line {number} holds text shaped like "
                              "one (a comment or a name); keep secrets in the nodes' environment", source=source)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"


def load_yaml(text: str, field: str, source: str, *, all_documents: bool = False) -> Any:
    """``yaml.safe_load`` of ``text`` once its event stream shows it is small enough: nesting at most
    ``MAX_DEPTH``, at most ``MAX_NODES`` nodes with every alias expanded, no alias inside its own anchor.
    ``all_documents``: the list of its non-empty documents (``safe_load_all``), bounded together."""
    import yaml  # an edge: the pure core never parses files

    try:
        _check_yaml_size(yaml.parse(text, Loader=yaml.SafeLoader), field, source)
        if all_documents:
            return [d for d in yaml.load_all(text, Loader=yaml.SafeLoader) if d is not None]
        return yaml.load(text, Loader=yaml.SafeLoader)
    except ConfigError:
        raise
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(field, source, f"expected valid YAML (not{where}: {problem})") from None
    except ValueError as exc:  # a scalar the constructor cannot convert, e.g. an integer of over 4300 digits
        raise ConfigError(field, source, f"expected valid YAML ({str(exc).splitlines()[0][:100]})") from None


def _check_yaml_size(events, field: str, source: str) -> None:
    import yaml

    open_sizes: list[list] = []  # per open collection: [expanded node count so far, its anchor]
    open_keys: list[list | None] = []  # per open collection: a mapping's [keys seen, next node is a key], or None
    anchored: dict[str, int] = {}  # anchor -> expanded node count of what it names
    open_anchors: set[str] = set()
    total = 0

    def place(event) -> None:
        """A node opens inside the innermost collection: a mapping's key must not repeat (PyYAML keeps the last)."""
        frame = open_keys[-1] if open_keys else None
        if frame is None:
            return
        keys, is_key = frame
        frame[1] = not is_key
        if is_key and isinstance(event, yaml.ScalarEvent) and event.value != "<<":
            if event.value in keys:
                raise ConfigError(field, source, f"expected each key once in a mapping (`{event.value[:60]}` is "
                                                 f"repeated at line {event.start_mark.line + 1}; YAML would keep the "
                                                 "last one silently)")
            keys.add(event.value)

    def add(count: int) -> None:
        nonlocal total
        total += count
        if total > MAX_NODES:
            raise ConfigError(field, source, f"expected a YAML document of at most {MAX_NODES:,} nodes with aliases "
                                             "expanded (an alias bomb?)")
        if open_sizes:
            open_sizes[-1][0] += count

    for event in events:
        if isinstance(event, (yaml.AliasEvent, yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            place(event)
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                raise ConfigError(field, source, f"expected a YAML document without self-reference (alias "
                                                 f"*{event.anchor} is inside its own anchor)")
            add(anchored.get(event.anchor, 1))
        elif isinstance(event, yaml.ScalarEvent):
            add(1)
            if event.anchor:
                anchored[event.anchor] = 1
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(open_sizes) >= MAX_DEPTH:
                raise ConfigError(field, source, f"expected YAML nested at most {MAX_DEPTH} levels deep")
            add(1)
            open_sizes.append([1, event.anchor])
            open_keys.append([set(), True] if isinstance(event, yaml.MappingStartEvent) else None)
            if event.anchor:
                open_anchors.add(event.anchor)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            size, anchor = open_sizes.pop()
            open_keys.pop()
            if open_sizes:
                open_sizes[-1][0] += size - 1  # its own node was counted when it opened
            if anchor:
                open_anchors.discard(anchor)
                anchored[anchor] = size


def load_json(text: str, field: str, source: str) -> Any:
    """``json.loads`` of ``text``; nesting too deep for the decoder is bad input, not a ``RecursionError``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(field, source, f"expected valid JSON (not: {exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ConfigError(field, source, "expected JSON nested less deeply (the decoder ran out of stack)") from None
    except ValueError as exc:  # an integer of over 4300 digits
        raise ConfigError(field, source, f"expected valid JSON ({str(exc).splitlines()[0][:100]})") from None


HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def is_host(text: str) -> bool:
    """Whether ``text`` is an IP address or an ASCII DNS name (labels of 1 to 63 letters, digits and -; at most 253
    characters): what a socket can be bound to or connected to without an encoding error."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", text):  # 999.1.1.1 is no address, and no name either
        return False
    labels = text.removesuffix(".").split(".")
    return 0 < len(text) <= 253 and all(HOST_LABEL.fullmatch(label) for label in labels)
