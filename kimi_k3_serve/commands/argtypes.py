"""argparse value types shared by the commands: one message per kind of bad value."""

from __future__ import annotations

import argparse
import re

# The bounds on counts, shared with the deploy config's schema: far above any real deployment.
from kimi_k3_serve.planning.layout import MAX_BATCHED_TOKENS, MAX_DP, MAX_NUM_SEQS, MAX_PP, MAX_TP

MAX_LAYERS = MAX_PP


def positive_int(text: str) -> int:
    """An integer >= 1; ``_`` and ``,`` may group digits (``32_768``, ``1,048,576``)."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a positive integer")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1], such as a gpu_memory_utilization."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number in (0, 1]") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a number in (0, 1]")
    return value


def int_from(low: int, high: int):
    """An argparse type: an integer from ``low`` to ``high`` (``_`` and ``,`` may group digits). Counts are bounded
    so that a typo (``--nodes 1000000000``) is refused at once rather than building that many nodes."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", "").replace(",", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer from {low:,} to {high:,}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected an integer from {low:,} to {high:,}")
        return value

    parse.__name__ = f"integer from {low} to {high}"
    return parse


def png_path(text: str) -> str:
    """A PNG file to write: a name ending in .png (the plot is always a PNG) in a folder that exists and can be
    written, checked before any work so that a bad name is not found after the check has run."""
    import os

    if not text.lower().endswith(".png") or os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a file name ending in .png")
    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a .png file in an existing folder ({folder} is not one)")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a .png file in a folder we may write ({folder} is not)")
    if os.path.islink(text) and not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a .png file we can write, not a dangling "
                                         "symbolic link")
    existed = os.path.lexists(text)
    try:  # open it now: a name too long, a dangling link or a folder like /proc fails here, not after the check
        with open(text, "ab"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a .png file we can write ({exc.strerror})") from None
    if not existed:
        os.unlink(text)
    return text


ADDRESS_ALLOWED = "expected 'auto', host:port (the GCS, default port 6379) or ray://host:port"


def ray_address(text: str) -> str:
    """A Ray cluster's address, checked before anything connects: 'auto', or ``[ray://]host:port`` with an ASCII host
    name or IP address (an internationalised name goes in its xn-- form) and a port from 1 to 65535."""
    from kimi_k3_serve.inputs import is_host

    if text == "auto":
        return text
    host, sep, port = text.removeprefix("ray://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"got {text!r}; {ADDRESS_ALLOWED}, the port from 1 to 65535")
    if not is_host(host):
        raise argparse.ArgumentTypeError(f"got {text!r}; {ADDRESS_ALLOWED}, the host an IP address or a DNS name "
                                         "(ASCII letters, digits and -, labels of 1 to 63 characters)")
    return text


def nonempty(text: str) -> str:
    """A name or path that must not be empty: an empty one would silently mean "not given"."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a non-empty value")
    return text
