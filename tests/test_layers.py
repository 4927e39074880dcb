"""The import rules of the layers, read from the source (no imports run, so this takes milliseconds).

Layers, lowest first (docs/ARCHITECTURE.md says why):

    base (config, protocol, counters, routing) -> kernels -> correction, guard math -> learning -> cache
    -> chat, admin -> server -> launch_server;   frontend (the client library) on base only

A module never imports one of a higher layer, nor one of a sibling layer of the same rank
(chat and admin know nothing of each other); the installed package never imports
benchmarks/, devtools/ or tests/; and no set of modules imports itself round a cycle,
counting imports inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the dotted name its modules install under
PACKAGES = {"sglang_kvshare": "sglang_kvshare", "kernels": "sglang_kvshare.kernels",
            "frontend": "sglang_kvshare.frontend"}
# (layer rank, dotted prefixes); a prefix names a package or a single module
LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("sglang_kvshare.config", "sglang_kvshare.protocol", "sglang_kvshare.counters", "sglang_kvshare.routing",
         "sglang_kvshare.guard.target")),  # the target syntax: the config validates its flag with it
    (1, ("sglang_kvshare.kernels",)),
    (2, ("sglang_kvshare.correction",)),
    (2, ("sglang_kvshare.guard",)),  # the fidelity guard's math; its serving side ranks with chat and admin
    (3, ("sglang_kvshare.learning",)),
    (4, ("sglang_kvshare.cache",)),
    (5, ("sglang_kvshare.chat",)),
    (5, ("sglang_kvshare.admin",)),
    (6, ("sglang_kvshare.server",)),
    (7, ("sglang_kvshare.launch_server",)),
    (1, ("sglang_kvshare.frontend",)),  # the client: base only, never the server side
]
ROOT_PACKAGE = "sglang_kvshare"


def _imports(path: Path, package: str) -> set[tuple[str, str]]:
    """Every import of ``path``, at any depth (function-level imports too), as (module, name) pairs.

    ``import a.b`` gives ``("a.b", "")``; ``from a import b`` gives ``("a", "b")``:
    ``b`` may be a submodule of ``a`` or a name defined in ``a`` (``_target`` decides).
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update((alias.name, "") for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.update((mod, alias.name) for alias in node.names)
    return names


def _modules() -> dict[str, set[tuple[str, str]]]:
    out = {}
    for folder, dotted in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([dotted, *parts])
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            out[name] = _imports(path, package)
    return out


MODULES = _modules()


def _layer(module: str) -> tuple[int, str] | None:
    """(rank, the layer's first prefix) of a module; None for the package root itself."""
    best = None
    for rank, prefixes in LAYERS:
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (rank, prefixes[0])
    return best


def _target(module: str, name: str) -> str | None:
    """The module of ours an import reaches: the submodule ``module.name`` if there is one, else ``module``."""
    if name and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    while module:
        if module in MODULES:
            return module
        module = module.rpartition(".")[0]
    return None


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, imps in MODULES.items():
        targets = {_target(m, n) for m, n in imps}
        graph[mod] = {t for t in targets if t is not None and t != mod and t != ROOT_PACKAGE}
    return graph


def test_every_module_has_a_layer():
    assert MODULES, "no modules found: is the test running from a checkout?"
    unplaced = [m for m in MODULES if m != ROOT_PACKAGE and _layer(m) is None]
    assert unplaced == [], "add these modules to a layer in LAYERS (and docs/ARCHITECTURE.md)"


def test_no_module_imports_a_higher_or_a_sibling_layer():
    offenders = []
    for mod, targets in sorted(_edges().items()):
        mine = _layer(mod)
        for target in sorted(targets):
            theirs = _layer(target)
            if mine is None or theirs is None:
                continue
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                offenders.append(f"{mod} (layer {mine[0]}) imports {target} (layer {theirs[0]})")
    assert offenders == []


def test_the_package_never_imports_benchmarks_devtools_or_tests():
    offenders = [f"{mod} imports {imp}" for mod, imps in sorted(MODULES.items()) for imp, _ in sorted(imps)
                 if imp.split(".")[0] in ("benchmarks", "devtools", "tests")]
    assert offenders == []


def test_no_import_cycles():
    graph = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


ADAPTER = "sglang_kvshare.cache.adapter"


def test_no_step_of_the_cache_imports_the_adapter():
    """The adapter holds SGLang's overrides and calls the pipeline (``cache/pipeline.py``); no other module of the
    cache imports it, directly or through another, so no step can call back into it."""
    graph = _edges()
    offenders = []
    for mod in sorted(MODULES):
        if not mod.startswith("sglang_kvshare.cache.") or mod == ADAPTER:
            continue
        seen, todo = set(), [mod]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        if ADAPTER in seen:
            offenders.append(mod)
    assert "sglang_kvshare.cache.pipeline" in MODULES and offenders == []


@pytest.mark.parametrize("module, planted_import, check", [
    ("sglang_kvshare.cache.registry", ("sglang_kvshare.cache.adapter", ""), "test_no_import_cycles"),
    ("sglang_kvshare.correction.rope", ("sglang_kvshare.cache.adapter", ""),
     "test_no_module_imports_a_higher_or_a_sibling_layer"),
    ("sglang_kvshare.cache.tree_paths", ("sglang_kvshare.cache", "adapter"),
     "test_no_step_of_the_cache_imports_the_adapter"),
])
def test_the_checks_catch_a_planted_violation(module, planted_import, check, monkeypatch):
    """The rules above can fail: a planted cycle, a planted upward import and a step that imports the adapter
    are all reported."""
    planted = {**MODULES, module: MODULES[module] | {planted_import}}
    monkeypatch.setattr(__import__(__name__, fromlist=["MODULES"]), "MODULES", planted)
    with pytest.raises(AssertionError):
        globals()[check]()
