"""The import rules of the layers, read from the source (no imports run, so this takes milliseconds).

Layers, lowest first: kernels/ -> sglang_kvshare/correction -> sglang_kvshare/cache ->
plugin / launcher / admin -> frontend/ (client library) and benchmarks/. A layer never
imports a higher one; the installed package never imports benchmarks/ (it is not installed).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the dotted name its modules install under
PACKAGES = {"sglang_kvshare": "sglang_kvshare", "kernels": "sglang_kvshare.kernels",
            "frontend": "sglang_kvshare.frontend"}


def _imports(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports, at any depth (function-level imports too), resolved to dotted names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{alias.name}" for alias in node.names)
    return names


def _modules() -> dict[str, set[str]]:
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


def _offenders(importer_prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{mod} imports {imp}" for mod, imps in sorted(MODULES.items())
            if mod == importer_prefix or mod.startswith(importer_prefix + ".")
            for imp in sorted(imps) if any(imp == f or imp.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("importer, forbidden", [
    ("sglang_kvshare", ("benchmarks", "tests")),
    ("sglang_kvshare.kernels", ("sglang_kvshare.correction", "sglang_kvshare.cache", "sglang_kvshare.admin",
                                "sglang_kvshare.plugin", "sglang_kvshare.frontend")),
    ("sglang_kvshare.correction", ("sglang_kvshare.cache", "sglang_kvshare.admin", "sglang_kvshare.plugin",
                                   "sglang_kvshare.frontend", "sglang_kvshare.launch_server")),
    ("sglang_kvshare.cache", ("sglang_kvshare.admin", "sglang_kvshare.plugin", "sglang_kvshare.frontend",
                              "sglang_kvshare.launch_server")),
    ("sglang_kvshare.admin", ("sglang_kvshare.plugin", "sglang_kvshare.frontend")),
])
def test_no_layer_imports_a_higher_one(importer, forbidden):
    assert MODULES, "no modules found: is the test running from a checkout?"
    assert _offenders(importer, forbidden) == []
