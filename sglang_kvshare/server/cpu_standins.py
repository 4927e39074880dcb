"""Import-only stand-ins that let SGLang 0.5.23 start on a CPU-only machine.

Why: two modules that SGLang imports unconditionally are missing or broken in
a lean CPU environment, although text models never call into them:

* ``torchvision``: imported by multimodal helpers at module load
  (``sglang.srt.multimodal.internvl_utils``). PyPI's torchvision next to the
  CPU torch wheel fails with ``operator torchvision::nms does not exist``.
* ``vllm._custom_ops.rotary_embedding``: imported by
  ``sglang/srt/layers/rotary_embedding/base.py`` on a platform that is neither
  CUDA nor SGLang's own CPU engine. The native torch rotary path is what runs.

``install()`` registers a stand-in only for a package that cannot be imported
for real, so a full (GPU) install is never affected. Every attribute of a
stand-in raises a clear error when *used*, so nothing can silently compute
with it. SGLang spawns its scheduler and detokenizer processes, so the stand-ins
must exist before SGLang's modules load in every process: the lean setup writes
``sglang_kvshare_cpu_standins.pth`` into the environment's site-packages
(see ``scripts/setup.sh``), and the launcher also calls ``install()`` at import.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

_INSTALLED: list[str] = []


class StandInUsedError(RuntimeError):
    """A stand-in module was called: the feature needs the real package."""


def _unusable(qualname: str):
    def _raise(*_args, **_kwargs):
        raise StandInUsedError(
            f"{qualname} is an import-only CPU stand-in installed by sglang_kvshare.server.cpu_standins; "
            "this feature needs the real package (install the full sglang extras on a GPU machine)."
        )

    _raise.__name__ = qualname.rsplit(".", 1)[-1]
    return _raise


class _StandInModule(types.ModuleType):
    """A module whose every missing attribute is a placeholder that raises on use."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unusable(f"{self.__name__}.{name}")


def _really_importable(name: str) -> bool:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if name == "torchvision":
        # The PyPI wheel is present but may not load beside a CPU torch.
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any failure means "not usable"
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
            return False
    return True


def _register(name: str, *, package: bool, attrs: dict | None = None, strict: bool = False) -> None:
    mod = types.ModuleType(name) if strict else _StandInModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []
    for key, value in (attrs or {}).items():
        setattr(mod, key, value)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, mod)


def install() -> list[str]:
    """Register the stand-ins that are needed here; idempotent. Returns their names."""
    if _INSTALLED:
        return list(_INSTALLED)
    if not _really_importable("torchvision"):
        for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                     "torchvision.transforms.v2.functional", "torchvision.transforms.functional",
                     "torchvision.io"):
            _register(name, package=True)
        # transformers reads the version of any importable torchvision; an old one
        # keeps it on its PIL image paths, which text models never reach anyway.
        sys.modules["torchvision"].__version__ = "0.0.0"
        sys.modules["torchvision.transforms"].InterpolationMode = _StandInModule(
            "torchvision.transforms.InterpolationMode")
        _INSTALLED.append("torchvision")
    if not _really_importable("vllm"):
        # Strict: only the one name SGLang's CPU path imports exists, so code that
        # probes vllm for other ops (`from vllm._custom_ops import rms_norm`) still
        # gets the ImportError it expects and takes its own fallback.
        _register("vllm", package=True, strict=True)
        _register("vllm._custom_ops", package=False, strict=True,
                  attrs={"rotary_embedding": _unusable("vllm._custom_ops.rotary_embedding")})
        _INSTALLED.append("vllm._custom_ops")
    return list(_INSTALLED)
