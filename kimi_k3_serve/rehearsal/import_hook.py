"""Wrapping a vLLM module's functions from a vLLM plugin without importing that module: the rehearsal plugin's
entry points (``graph_samples``, ``profile_peak``) run in every process that loads plugins, the rehearsal's own
among them, and must not import vLLM's worker code there. Standard-library imports only."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


def wrap_on_import(name: str, wrap: Callable[[Any], None]) -> None:
    """Call ``wrap`` on module ``name`` now if it is imported, else once its import has run it."""
    module = sys.modules.get(name)
    if module is not None:
        wrap(module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _WrapOnImport) and f.name == name), None)
    if finder is None:
        sys.meta_path.insert(0, _WrapOnImport(name, wrap))
    else:  # another entry point wraps the same module: both run, each wrap guards against wrapping twice
        finder.wraps.append(wrap)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as the rest of ``sys.meta_path`` would, and runs its wraps once the module has run."""

    def __init__(self, name: str, wrap: Callable[[Any], None]) -> None:
        self.name, self.wraps = name, [wrap]

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            run_module = spec.loader.exec_module

            def exec_and_wrap(module) -> None:
                run_module(module)
                for wrap in self.wraps:
                    wrap(module)

            spec.loader.exec_module = exec_and_wrap
        return spec
