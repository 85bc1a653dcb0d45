"""Errors a user can act on. Each names what was wrong and what is allowed; the CLI prints them without
a traceback and exits with code 2 (bad input) or 1 (does not fit)."""

from __future__ import annotations

from typing import Any


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
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: got {_show(value)}; {allowed}")


class UnsupportedModelError(ConfigError):
    """A model architecture or config field the inventory does not know: never guessed."""


class DoesNotFitError(KimiK3ServeError):
    """A layout was checked and at least one GPU is short; ``report`` carries the per-GPU numbers."""

    def __init__(self, message: str, report: Any = None) -> None:
        self.report = report
        super().__init__(message)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
