"""Byte units. Sizes are ``int`` bytes inside; these helpers only format them, always with the unit."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9
MB = 10**6


def fmt_gib(nbytes: int | float, digits: int = 2) -> str:
    return f"{nbytes / GiB:,.{digits}f} GiB"


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (vLLM's ``cdiv``)."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def fmt_size(nbytes: int | float) -> str:
    """GiB, or MiB below a tenth of a GiB (a tiny test checkpoint still reads as a number), always labelled."""
    return fmt_gib(nbytes) if abs(nbytes) >= GiB // 10 else f"{nbytes / MiB:,.2f} MiB"
