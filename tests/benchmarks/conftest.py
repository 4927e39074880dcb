"""A tiny random Llama for the offline harness's math (no server, no real model)."""

from __future__ import annotations

import pytest

from tests.tiny_models import tiny_llama


@pytest.fixture(scope="module")
def tiny():
    """Eager attention, so a test can read the model's own attention weights."""
    return tiny_llama(max_position_embeddings=4096, attn_implementation="eager")
