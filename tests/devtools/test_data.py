"""The repository ships its data: the GSM8K test split is found in data/, and a missing file is a clear error."""

from __future__ import annotations

import json

import pytest

from devtools import data


def test_gsm8k_ships_in_the_repository_with_its_licence():
    path = data.gsm8k_path()
    assert path.parent.name == "gsm8k" and path.parent.parent.name == "data"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1319 and all("####" in r["answer"] and r["question"] for r in rows)
    assert "MIT License" in (path.parent / "LICENSE").read_text()


def test_a_missing_data_file_is_an_error_naming_it(monkeypatch, tmp_path):
    missing = tmp_path / "data" / "gsm8k" / "test.jsonl"
    monkeypatch.setattr(data, "GSM8K_TEST", missing)
    with pytest.raises(FileNotFoundError, match="data/gsm8k"):
        data.gsm8k_path()
