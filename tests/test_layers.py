"""The import contract: kimi_k3_serve's layers only point down, and the planner core stays pure.

Read from the source (every module's AST, imports inside functions and ``TYPE_CHECKING`` blocks included), so
nothing is imported. Bottom to top:

- base: the package root, ``errors``, ``inputs`` (bounded file reading), ``recorded`` (recorded runs' logs, plain or
  gzipped), ``units``;  ``data/`` and ``models/data/`` hold package data only;
- ``models/``: model inventories from config.json;
- ``planning/``: hardware, engine settings, KV cache, memory, optimisations, placement, the planner, its report,
  the one translation to vLLM -- never ray, torch, vllm, yaml or pynvml;
- ``cluster/``, ``checkpoint/``: declared cluster files, the live Ray inventory, NVML; checkpoint listings, node disks, prefetch;
- ``config/``: the ``args`` schema, model sources, the Serve-file reader and schema, the ``ServeArgs`` adapter;
- ``checks/``: the build-time and replica-start checks;
- ``serving/``: the LLM server, ingress, health, streaming;
- ``clusterfiles/``: the cluster-file renderers;
- ``rehearsal/``: vLLM's engine on dummy weights, read and compared with the plan;
- ``commands/``: the subcommands;
- top: ``cli`` and ``app`` (``kimi_k3_serve.app:build_app``).
A module may import its own layer and the layers below it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = "kimi_k3_serve"
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", (PKG, f"{PKG}.errors", f"{PKG}.inputs", f"{PKG}.recorded", f"{PKG}.tokens", f"{PKG}.units")),
    ("models", (f"{PKG}.models",)),
    ("planning", (f"{PKG}.planning",)),
    ("cluster", (f"{PKG}.cluster", f"{PKG}.checkpoint")),
    ("config", (f"{PKG}.config",)),
    ("checks", (f"{PKG}.checks",)),
    ("serving", (f"{PKG}.serving",)),
    ("clusterfiles", (f"{PKG}.clusterfiles",)),
    ("rehearsal", (f"{PKG}.rehearsal",)),
    ("commands", (f"{PKG}.commands",)),
    ("top", (f"{PKG}.cli", f"{PKG}.app")),
]
PURE_LAYER = "planning"
IMPURE = ("ray", "torch", "vllm", "yaml", "pynvml")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted((REPO / PKG).rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """The layer of a module: the longest matching prefix (the root alone is base, not everything below it)."""
    best, length = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            matches = module == prefix if prefix == PKG else (module == prefix or module.startswith(prefix + "."))
            if matches and len(prefix) > length:
                best, length = name, len(prefix)
    return best


RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def _resolve(module: str) -> str:
    """The module a dotted name imports: itself when it is a module or package, else its parent (a name in it)."""
    while module not in MODULES and "." in module:
        module = module.rsplit(".", 1)[0]
    return module


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module or top-level package) for every import statement of a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(PKG):
                found += [(node.lineno, _resolve(f"{node.module}.{alias.name}")) for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def test_every_module_has_a_layer():
    assert not [m for m in MODULES if layer_of(m) is None], "a module outside every layer: add it to LAYERS"
    assert len({layer_of(m) for m in MODULES}) == len(LAYERS), "a layer without a module: LAYERS is stale"


def test_data_folders_hold_data_only():
    for data in (REPO / PKG / "data", REPO / PKG / "models" / "data"):
        assert data.is_dir() and not list(data.rglob("*.py")), data


def test_imports_only_point_down():
    upward = []
    for module, path in MODULES.items():
        rank = RANK[layer_of(module)]
        for line, target in imports_of(path):
            if target.startswith(PKG) and RANK[layer_of(target)] > rank:
                upward.append(f"{path.relative_to(REPO)}:{line} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    assert not upward, "\n".join(upward)


def test_planning_never_imports_ray_torch_vllm_yaml_or_pynvml():
    impure = [f"{path.relative_to(REPO)}:{line} imports {target}"
              for module, path in MODULES.items() if layer_of(module) == PURE_LAYER
              for line, target in imports_of(path) if target.split(".")[0] in IMPURE]
    assert not impure, "\n".join(impure)


def test_no_import_cycle():
    graph = {m: {t for _, t in imports_of(p) if t.startswith(PKG) and t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target == PKG:  # the root package's version string
                continue
            if state.get(target) == 1:
                return stack + [module, target]
            if target not in state and (cycle := visit(target, stack + [module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            assert cycle is None, " -> ".join(cycle[cycle.index(cycle[-1]):])


STRING_PATH = re.compile(rf"\b({PKG}(?:\.\w+)*):(\w+)\b")


@pytest.mark.parametrize("folder", ["deploy", "cluster_configs", PKG])
def test_the_class_paths_serve_stores_as_strings_exist(folder):
    """``module:attribute`` strings (Serve's ``import_path``, what the cluster files embed, the callback class
    Ray Serve LLM loads by name) name a module of the package and an attribute it defines."""
    seen = 0
    for path in sorted((REPO / folder).rglob("*")):
        if not path.is_file() or path.suffix not in (".py", ".yaml", ".yml", ".json"):
            continue
        for module, attribute in STRING_PATH.findall(path.read_text(errors="replace")):
            seen += 1
            assert module in MODULES, f"{path.relative_to(REPO)}: {module}:{attribute} names no module"
            tree = ast.parse(MODULES[module].read_text())
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))}
            assert attribute in defined, f"{path.relative_to(REPO)}: {module} defines no {attribute}"
    if folder != PKG:
        assert seen, f"no module:attribute string under {folder}/"
