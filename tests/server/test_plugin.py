"""Entry point registration, the kvshare backend in SGLang's registry, CPU stand-ins."""

from __future__ import annotations

from importlib.metadata import distribution, entry_points

import pytest


def test_entry_point_is_declared_in_the_installed_distribution():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvshare"]
    assert eps and eps[0].value == "sglang_kvshare.server.plugin:load_plugin"
    assert distribution("sglang-kvshare").metadata["Name"] == "sglang-kvshare"


def test_load_plugin_registers_the_backend_idempotently():
    from sglang.srt.mem_cache.registry import get_radix_cache_factory

    from sglang_kvshare.server.plugin import load_plugin

    load_plugin()
    load_plugin()
    assert get_radix_cache_factory("kvshare") is not None


def test_no_top_level_kernels_or_frontend_module_comes_from_this_project():
    import sglang_kvshare.frontend
    import sglang_kvshare.kernels

    assert sglang_kvshare.kernels.__name__ == "sglang_kvshare.kernels"
    top_level = distribution("sglang-kvshare").read_text("top_level.txt") or ""
    assert top_level.split() == ["sglang_kvshare"]


def test_standins_raise_a_clear_error_when_used():
    from sglang_kvshare.server import cpu_standins

    names = cpu_standins.install()
    if "vllm._custom_ops" not in names:
        pytest.skip("the real vllm is installed here")
    from vllm._custom_ops import rotary_embedding

    with pytest.raises(cpu_standins.StandInUsedError, match="stand-in"):
        rotary_embedding()
    with pytest.raises(ImportError):
        from vllm._custom_ops import rms_norm  # noqa: F401
