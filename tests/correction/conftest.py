"""Fixtures of the correction tests: seeded RNG, a tiny random Llama, the real model."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import tiny_llama as _tiny_llama

torch.set_num_threads(1)  # NOTE: 2 OpenMP threads on a shared 2-core box spin pathologically


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture(scope="session")
def tiny_llama():
    return _tiny_llama()


@pytest.fixture(scope="session")
def make_tiny_llama():
    return _tiny_llama


def cache_of(model, ids: torch.Tensor, position_ids: torch.Tensor | None = None):
    """Run ``ids`` (1-D LongTensor) and return K, V ``[num_layers, T, kv_heads, head_dim]``."""
    with torch.no_grad():
        out = model(input_ids=ids[None], position_ids=None if position_ids is None else position_ids[None],
                    use_cache=True)
    layers = out.past_key_values.layers
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in layers])
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in layers])
    return k, v


@pytest.fixture(scope="session")
def kv_of():
    return cache_of


@pytest.fixture(scope="session")
def real_model():
    from transformers import AutoModelForCausalLM

    from devtools.models import prepare

    path = prepare("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
