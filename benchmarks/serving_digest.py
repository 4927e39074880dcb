"""Which serving code a measurement ran: one sha256 over the installed package's sources and its dependency pins.

Why a digest and not only the git revision: a results file must say whether it
still describes the code of the tree it sits in, and CI checks that on a fresh
clone without history (no git call: a shallow clone cannot resolve an old
revision, and a revision names the benchmarks' and docs' changes too, which do
not change what a server does). The digest covers what a server runs: every
``*.py`` file of the packages ``pyproject.toml`` installs as ``sglang_kvshare``
(``sglang_kvshare/``, and ``kernels/`` and ``frontend/``, which install inside
it) and the ``[project] dependencies`` pins. ``benchmarks.harness.run_meta``
records it as ``serving_digest``; ``benchmarks.report`` marks a result stale
when it differs from the tree's.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Iterable, Mapping, Optional

ROOT = Path(__file__).resolve().parent.parent
SERVING_PACKAGES = ("sglang_kvshare", "kernels", "frontend")
"""The folders ``pyproject.toml`` installs as the ``sglang_kvshare`` package (its ``package-dir``)."""

_DEPENDENCIES = re.compile(r"^dependencies\s*=\s*\[(.*?)^\]", re.MULTILINE | re.DOTALL)


def dependency_pins(pyproject_text: str) -> list[str]:
    """The ``[project] dependencies`` entries of a ``pyproject.toml`` text, sorted (comments dropped)."""
    match = _DEPENDENCIES.search(pyproject_text)
    if match is None:
        return []
    lines = (line.split("#", 1)[0] for line in match.group(1).splitlines())
    return sorted(pin for line in lines for pin in re.findall(r'"([^"]+)"', line))


def serving_digest(root: Path = ROOT) -> str:
    """sha256 (hex) over the sorted relative paths and contents of the serving ``*.py`` files under ``root``, then
    the dependency pins of ``root/pyproject.toml``. Reads the working tree as it is (uncommitted edits count);
    ``__pycache__`` holds no ``*.py`` and so never counts."""
    files = sorted((p.relative_to(root).as_posix(), p) for pkg in SERVING_PACKAGES
                   for p in (root / pkg).rglob("*.py") if p.is_file())
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    pyproject = root / "pyproject.toml"
    pins = dependency_pins(pyproject.read_text()) if pyproject.is_file() else []
    h.update(b"dependencies\0" + "\n".join(pins).encode())
    return h.hexdigest()


def common_digest(metas: Iterable[Optional[Mapping]]) -> Optional[str]:
    """The ``serving_digest`` every one of ``metas`` records, or None when one lacks it or two differ.

    Why: a file merged or pooled from parts measured one serving code only when all its parts did."""
    digests = {(m or {}).get("serving_digest") for m in metas}
    if len(digests) != 1:
        return None
    return digests.pop()
