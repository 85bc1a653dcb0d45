"""Errors a user can act on. Each names what was wrong and what is allowed; the CLI prints them without
a traceback and exits with code 2 (bad input) or 1 (does not fit)."""

from __future__ import annotations

from typing import Any, Mapping, Protocol


class KimiK3ServeError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(KimiK3ServeError, ValueError):
    """Bad input: a config, cluster file, model config.json or command-line value.

    ``field`` is a dotted path ("args.parallel.tensor_parallel_size"), ``value`` what was given and
    ``allowed`` what would be accepted, in words.
    """

    def __init__(self, field: str, value: Any, allowed: str, *, source: str | None = None) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.source = source
        where = f"{_shown_source(source)}: " if source else ""
        super().__init__(f"{where}{field}: got {_show(value)}; {allowed}")


class UnsupportedModelError(ConfigError):
    """A model architecture or config field the inventory does not know: never guessed."""


class PerGpuReport(Protocol):
    """The per-GPU verdict a does-not-fit error carries (``report.CheckReport``): one row per GPU."""

    fits: bool
    verdict: str
    rows: tuple[Any, ...]

    def to_json(self) -> dict[str, Any]: ...


class DoesNotFitError(KimiK3ServeError):
    """A deployment was checked and does not fit. ``report``: the per-GPU numbers when GPUs were sized;
    ``details``: the figures of any other refusal (placement, host memory), for logs and JSON."""

    def __init__(self, message: str, report: PerGpuReport | None = None, *,
                 details: Mapping[str, Any] | None = None) -> None:
        self.report = report
        self.details = dict(details or {})
        super().__init__(message)


def _show(value: Any) -> str:
    """The value as an error shows it: credential-shaped parts masked (before the cut, which could hide their shape),
    at most 120 characters."""
    from kimi_k3_serve.tokens import mask_tokens

    text = mask_tokens(repr(value))
    return text if len(text) <= 120 else text[:117] + "..."


def _shown_source(source: str) -> str:
    from kimi_k3_serve.tokens import mask_tokens

    return mask_tokens(str(source))
