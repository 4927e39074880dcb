"""docs/RESULTS.md is generated from the canonical results files, and those files are all there is.

Why these checks: a results table typed by hand drifts from the JSON it quotes, and a
folder of copies under variant names leaves a reader guessing which run is current.
``benchmarks.report`` holds the registry of canonical files; these tests hold the
committed markdown, the results folder and every file's ``meta`` to it. No plots are
drawn and no server starts, so this runs in about a second.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.harness import run_meta

RAW_PROFILE_SUFFIX = ".folded.txt"  # py-spy's raw stacks beside profile_*.json: git-ignored, never committed
NO_PROCESS_WORDS = re.compile(r"\bsessions? \d+|\bs1\d\b|\bissues? #?\d+|\bissue-\d+|before this\s+change",
                              re.IGNORECASE)


def test_results_md_is_what_the_committed_json_gives():
    have = report.DOC.read_text()
    want = report.render()
    assert have == want, "docs/RESULTS.md is stale: run python -m benchmarks.report"
    assert report.headline_markdown() in have


def test_readme_headline_block_is_what_the_committed_json_gives():
    have = report.README.read_text()
    assert have == report.readme_with_headline(have), "README's headline block is stale: run python -m benchmarks.report"
    assert report.headline_markdown(link="docs/RESULTS.md") in have


def test_the_report_is_deterministic():
    assert report.render() == report.render()


def test_every_canonical_file_records_command_machine_date_and_revision():
    for entry in report.present():
        meta = report.load(entry)["meta"]
        assert isinstance(meta["command"], str) and meta["command"].startswith("python -m "), entry.file
        assert meta["machine"], entry.file
        datetime.fromisoformat(meta["date"])
        assert re.fullmatch(r"[0-9a-f]{40}", meta["git_revision"] or ""), entry.file


def test_the_results_folder_holds_only_canonical_files():
    present = {p.name for p in report.RESULTS.iterdir() if not p.name.endswith(RAW_PROFILE_SUFFIX)}
    assert present == report.canonical_files()


def test_the_report_holds_no_process_words():
    text = report.DOC.read_text()
    assert [line for line in text.splitlines() if NO_PROCESS_WORDS.search(line)] == []


def _copy_of_results(tmp_path: Path, without: str = "") -> Path:
    folder = tmp_path / "results"
    folder.mkdir()
    for entry in report.present():
        if entry.file != without:
            (folder / entry.file).symlink_to(report.RESULTS / entry.file)
    return folder


def test_a_missing_canonical_file_is_an_error_naming_it(tmp_path):
    folder = _copy_of_results(tmp_path, without="serving.json")
    with pytest.raises(report.ReportError, match=r"serving\.json.*missing"):
        report.render(folder)
    assert report.main(["--check", "--results", str(folder)]) == 2


def test_an_optional_entry_is_left_out_while_its_file_is_missing(tmp_path):
    optional = [entry for entry in report.REGISTRY if entry.optional]
    assert optional, "the registry has no optional entry to check"
    folder = _copy_of_results(tmp_path, without=optional[0].file)
    (folder / optional[0].file).unlink(missing_ok=True)
    text = report.render(folder)
    assert f"## {optional[0].name}\n" not in text and f"[{optional[0].name}](#" not in text
    assert optional[0].file not in report.canonical_files(folder)


def test_a_malformed_canonical_file_is_an_error_naming_it(tmp_path):
    folder = _copy_of_results(tmp_path, without="learn_cost.json")
    (folder / "learn_cost.json").write_text("{not json")
    with pytest.raises(report.ReportError, match=r"learn_cost\.json: not valid JSON"):
        report.render(folder)
    data = json.loads((report.RESULTS / "learn_cost.json").read_text())
    (folder / "learn_cost.json").write_text(json.dumps({k: v for k, v in data.items() if k != "meta"}))
    with pytest.raises(report.ReportError, match=r"learn_cost\.json: meta lacks command"):
        report.render(folder)
    (folder / "learn_cost.json").write_text(json.dumps({"meta": data["meta"], "rows": [{}]}))
    with pytest.raises(report.ReportError, match=r"learn_cost\.json: malformed"):
        report.render(folder)


def test_check_fails_with_a_diff_when_the_markdown_is_stale(tmp_path, capsys):
    doc = tmp_path / "RESULTS.md"
    doc.write_text(report.render().replace("## Headline results", "## Headlines"))
    assert report.main(["--check", "--out", str(doc)]) == 1
    assert "+## Headline results" in capsys.readouterr().err
    doc.write_text(report.render())
    assert report.main(["--check", "--out", str(doc)]) == 0


def test_run_meta_names_the_command_and_the_checkout():
    meta = run_meta("python -m benchmarks.serving --quick")
    assert meta["command"] == "python -m benchmarks.serving --quick"
    assert {"machine", "date", "git_revision", "git_dirty"} <= meta.keys()
    datetime.fromisoformat(meta["date"])
