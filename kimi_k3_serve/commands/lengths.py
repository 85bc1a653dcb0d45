"""The ``max_model_len`` that ``plan`` and ``memory`` use when ``--max-model-len`` is not given: the model
config's ``max_position_embeddings``, capped at the longest length that still fits, found by bisection on the
pure planner (a few dozen estimates, well under a second)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kimi_k3_serve.errors import ConfigError

LENGTH_STEP = 1024
"""Lengths tried below the model config's, in tokens: multiples of this (a whole number of KV blocks)."""


@dataclass(frozen=True)
class LengthChoice:
    value: int
    source: str
    """``--max-model-len``, ``model config`` or ``longest that fits``."""
    line: str
    """What the command prints about it."""

    def to_json(self) -> dict[str, object]:
        return {"max_model_len": self.value, "source": self.source, "reason": self.line}


def model_config_length(model) -> int:
    length = model.max_position_embeddings
    if not length:
        raise ConfigError("--max-model-len", None, "a length in tokens: the model config has no max_position_embeddings")
    return int(length)


def given(length: int) -> LengthChoice:
    return LengthChoice(length, "--max-model-len", f"max_model_len: {length:,} (--max-model-len)")


def longest_that_fits(config_length: int, fits: Callable[[int], bool]) -> LengthChoice:
    """``config_length`` when it fits; else the longest multiple of ``LENGTH_STEP`` below it that does (fitting is
    monotone: a shorter request never needs more memory); else ``config_length`` again, said not to fit, so the
    caller reports the shortfall at the model's own length."""
    if fits(config_length):
        return LengthChoice(config_length, "model config", f"max_model_len: {config_length:,} (model config)")
    step = LENGTH_STEP if config_length > LENGTH_STEP else 1
    top = (config_length - 1) // step  # lengths step, 2*step, ..., top*step lie below config_length
    if top < 1 or not fits(step):
        return LengthChoice(config_length, "model config",
                            f"max_model_len: {config_length:,} (model config) does not fit, and neither does "
                            f"{step:,}, the shortest tried")
    lo, hi = 1, top + 1  # fits(lo * step); hi * step does not fit (or is the config length itself)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step):
            lo = mid
        else:
            hi = mid
    value = lo * step
    return LengthChoice(value, "longest that fits",
                        f"max_model_len: {config_length:,} (model config) does not fit; using {value:,}, the longest "
                        f"that fits (in steps of {step:,} tokens; pass --max-model-len to choose)")
