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

from benchmarks import demo, report
from benchmarks.harness import run_meta
from benchmarks.serving_digest import common_digest, dependency_pins, serving_digest

RAW_PROFILE_SUFFIX = ".folded.txt"  # py-spy's raw stacks beside profile_*.json: git-ignored, never committed
NO_PROCESS_WORDS = re.compile(r"\bsessions? \d+|\bs1\d\b|\bissues? #?\d+|\bissue-\d+|before this\s+change",
                              re.IGNORECASE)


def test_results_md_is_what_the_committed_json_gives():
    # Freshness marks aside: a change of the serving code alone must not fail the suite (--check-fresh does).
    ok, message = report.check()
    assert ok, f"docs/RESULTS.md is out of date: run python -m benchmarks.report\n{message}"
    assert report.without_marks(report.headline_markdown()) in report.without_marks(report.DOC.read_text())


def test_readme_headline_block_is_what_the_committed_json_gives():
    have = report.README.read_text()
    assert report.without_marks(have) == report.without_marks(report.readme_with_headline(have)), \
        "README's headline block is out of date: run python -m benchmarks.report"
    assert report.without_marks(report.headline_markdown(link="docs/RESULTS.md")) in report.without_marks(have)


def test_the_generated_results_md_is_short():
    assert len(report.DOC.read_text().splitlines()) <= 400


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


def _copy_of_results(tmp_path: Path, without: str = "", digests: dict | None = None) -> Path:
    """The canonical files, linked; those named in ``digests`` written with that ``serving_digest`` instead."""
    folder = tmp_path / "results"
    folder.mkdir(parents=True)
    for entry in report.present():
        if entry.file == without:
            continue
        if entry.name in (digests or {}):
            data = json.loads((report.RESULTS / entry.file).read_text())
            data["meta"]["serving_digest"] = digests[entry.name]
            (folder / entry.file).write_text(json.dumps(data))
        else:
            (folder / entry.file).symlink_to(report.RESULTS / entry.file)
    return folder


def test_a_missing_canonical_file_is_an_error_naming_it(tmp_path):
    folder = _copy_of_results(tmp_path, without="stock_vs_off.json")
    with pytest.raises(report.ReportError, match=r"stock_vs_off\.json.*missing"):
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
    folder = _copy_of_results(tmp_path, without="kernels_cpu.json")
    (folder / "kernels_cpu.json").write_text("{not json")
    with pytest.raises(report.ReportError, match=r"kernels_cpu\.json: not valid JSON"):
        report.render(folder)
    data = json.loads((report.RESULTS / "kernels_cpu.json").read_text())
    (folder / "kernels_cpu.json").write_text(json.dumps({k: v for k, v in data.items() if k != "meta"}))
    with pytest.raises(report.ReportError, match=r"kernels_cpu\.json: meta lacks command"):
        report.render(folder)
    (folder / "kernels_cpu.json").write_text(json.dumps({"meta": data["meta"], "rows": [{}]}))
    with pytest.raises(report.ReportError, match=r"kernels_cpu\.json: malformed"):
        report.render(folder)


def test_check_fails_with_a_diff_when_the_markdown_is_stale(tmp_path, capsys):
    doc = tmp_path / "RESULTS.md"
    doc.write_text(report.render().replace("## Headline results", "## Headlines"))
    assert report.main(["--check", "--out", str(doc)]) == 1
    assert "+## Headline results" in capsys.readouterr().err
    doc.write_text(report.render())
    assert report.main(["--check", "--out", str(doc)]) == 0


def test_run_meta_names_the_command_and_the_checkout():
    meta = run_meta("python -m benchmarks.agent_traffic --quick")
    assert meta["command"] == "python -m benchmarks.agent_traffic --quick"
    assert {"machine", "date", "git_revision", "git_dirty"} <= meta.keys()
    datetime.fromisoformat(meta["date"])
    assert meta["serving_digest"] == serving_digest()


PYPROJECT = """[project]
dependencies = [
    "sglang==0.5.23",
    "torch",  # a comment's "quotes" do not count
]
[project.optional-dependencies]
test = ["pytest>=8"]
"""


def _tree(root: Path) -> Path:
    for rel, text in (("sglang_kvshare/config.py", "A = 1\n"), ("sglang_kvshare/cache/pool.py", "B = 2\n"),
                      ("kernels/rope.py", "C = 3\n"), ("pyproject.toml", PYPROJECT)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_serving_digest_covers_the_package_sources_and_the_dependency_pins(tmp_path):
    root = _tree(tmp_path)
    assert dependency_pins(PYPROJECT) == ["sglang==0.5.23", "torch"]
    first = serving_digest(root)
    assert re.fullmatch(r"[0-9a-f]{64}", first) and serving_digest(root) == first
    (root / "sglang_kvshare" / "notes.md").write_text("not code")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "x.py").write_text("not serving code")
    (root / "pyproject.toml").write_text(PYPROJECT.replace('"pytest>=8"', '"pytest>=9"'))
    assert serving_digest(root) == first, "only the serving sources and the dependency pins count"
    (root / "sglang_kvshare" / "cache" / "pool.py").write_text("B = 3\n")
    changed = serving_digest(root)
    assert changed != first
    (root / "kernels" / "rope.py").rename(root / "kernels" / "rope2.py")
    assert serving_digest(root) != changed, "a renamed file is other code"
    (root / "pyproject.toml").write_text(PYPROJECT.replace("sglang==0.5.23", "sglang==0.5.24"))
    assert serving_digest(root) not in (first, changed)


def test_freshness_compares_the_recorded_digest_with_the_tree():
    assert report.freshness({"meta": {"serving_digest": "a"}}, "a") is None
    assert report.freshness({"meta": {"serving_digest": "a"}}, "b") == report.CHANGED
    assert report.freshness({"meta": {"command": "x"}}, "a") == report.NO_DIGEST


def test_a_merged_file_is_fresh_only_when_every_part_shares_the_digest():
    parts = [{"serving_digest": "a"}, {"serving_digest": "a"}]
    assert common_digest(parts) == "a"
    assert report.freshness({"meta": {"serving_digest": common_digest(parts)}, "parts_meta": parts}, "a") is None
    parts[1] = {"serving_digest": "b"}
    assert common_digest(parts) is None
    merged = {"meta": {"serving_digest": common_digest(parts)}, "parts_meta": parts}
    assert report.freshness(merged, "a") == report.PARTS_DIFFER
    assert report.freshness({"meta": {"serving_digest": "a"}, "parts_meta": [{"serving_digest": "a"}, {}]},
                            "a") == report.NO_DIGEST
    # A guard run whose overhead came from another run: that run's code counts too.
    guard = {"meta": {"serving_digest": "a"}, "overhead_source": {"meta": {"serving_digest": "b"}}}
    assert report.freshness(guard, "a") == report.PARTS_DIFFER


def test_a_merged_frontier_file_records_the_digest_its_parts_share():
    from benchmarks import runs

    for digests, want in ((("a", "a"), "a"), (("a", "b"), None), (("a", None), None)):
        parts = [{"serving_digest": d} for d in digests]
        assert runs.joined_meta("python -m benchmarks.frontier --merge m.json", parts)["serving_digest"] == want


def test_stale_marks_stand_in_the_section_header_index_and_headline(tmp_path):
    folder = _copy_of_results(tmp_path, digests={"chain_ttft": "d1", "stock_vs_off": "d1"})
    fresh = report.render(folder, tree="d1")
    assert '## <a id="chain_ttft"></a>chain_ttft\n' in fresh
    chain_row = next(r for r in report.headline_rows(folder, tree="d1") if "chain_ttft" in r[-1])
    assert chain_row[-2] == "fresh"
    stale = report.render(folder, tree="d2")
    assert f'## <a id="chain_ttft"></a>chain_ttft - **stale** ({report.CHANGED})\n' in stale
    assert f"| [chain_ttft](#chain_ttft) | {report.BY_NAME['chain_ttft'].question} | **stale** (" in stale
    assert f"**stale** ({report.CHANGED}) | [chain_ttft](#chain_ttft) |" in stale
    assert f'## <a id="kernels"></a>kernels - **stale** ({report.NO_DIGEST})\n' in stale
    assert report.without_marks(fresh) == report.without_marks(stale)


def test_check_passes_when_only_the_marks_differ_and_check_fresh_fails_naming_the_commands(tmp_path, capsys):
    tree = serving_digest()
    every_headline = {entry.name: tree for entry in report.headline_entries()}  # fresh, whatever the repo's are
    folder = _copy_of_results(tmp_path, digests={**every_headline, "stock_vs_off": tree})
    doc = tmp_path / "RESULTS.md"
    doc.write_text(report.render(folder, tree="another tree"))
    assert report.main(["--check", "--out", str(doc), "--results", str(folder)]) == 0
    assert "stale marks" in capsys.readouterr().out
    assert report.main(["--check-fresh", "--results", str(folder)]) == 0
    folder2 = _copy_of_results(tmp_path / "2", digests={**every_headline, "chain_ttft": "old", "stock_vs_off": tree})
    assert report.main(["--check-fresh", "--results", str(folder2)]) == 1
    err = capsys.readouterr().err
    command = json.loads((report.RESULTS / "chain_ttft.json").read_text())["meta"]["command"]
    assert f"chain_ttft ({report.CHANGED})" in err and command in err and "stock_vs_off" not in err


def _demo_file(path: Path, digest: str) -> None:
    def rows(reused: int) -> list[dict]:
        return [{"question": 0, "agent": agent, "position": i, "prompt_tokens": 100,
                 "prefill_tokens": 100 if i == 1 else 100 - reused, "tokens_aligned": 0 if i == 1 else reused,
                 "tokens_corrected": 0, "tokens_recomputed": 0, "shared_tokens": 70, "ttft_s": 0.5 if reused else 1.0,
                 "latency_s": 1.0, "fallbacks": ["short_segment"] if i > 1 else [], "answer": "4"}
                for i, agent in enumerate(demo.ROLES, start=1)]

    arms = {"off": {"config": {"mode": "off"}, "totals": demo.totals(rows(0)), "requests": rows(0)},
            "kvshare": {"config": {"mode": "fullshared", "recompute_ratio": 0.15, "min_reuse_tokens": 256},
                        "totals": demo.totals(rows(60)), "requests": rows(60)}}
    meta = {"command": "python -m benchmarks.demo --out benchmarks/results/demo.json", "machine": {"cpu_count": 2},
            "date": "2026-01-01T00:00:00+00:00", "git_revision": "0" * 40, "serving_digest": digest}
    path.write_text(json.dumps({"meta": meta, "settings": {"questions": 1, "sheet_tokens": 1024, "max_new_tokens": 8},
                                "arms": arms, "summary": {"ttft_speedup_agents_2_4": 1.4,
                                                          "judge_final_number_equal_to_off": 1, "judged_questions": 1}}))


def test_demo_totals_count_prompt_prefilled_and_reused_tokens():
    rows = [{"position": p, "prompt_tokens": 10, "prefill_tokens": 4, "tokens_aligned": 5, "tokens_corrected": 1,
             "shared_tokens": 8, "ttft_s": float(p), "fallbacks": ["short_segment"] if p > 2 else []}
            for p in (1, 2, 3, 4)]
    t = demo.totals(rows)
    assert (t["requests"], t["prompt_tokens"], t["prefill_tokens"], t["reused_tokens"]) == (4, 40, 16, 24)
    assert t["reuse_ratio"] == 24 / 32 and t["ttft_s_mean_agent_1"] == 1.0 and t["ttft_s_mean_agents_2_4"] == 3.0
    assert t["fallback_requests_by_reason"] == {"short_segment": 2}
    assert demo.last_number("The answer is 1,234.") == "1234" and demo.last_number("none") == ""


def test_the_headline_renders_optional_rows_whose_file_exists_and_skips_them_silently_otherwise(tmp_path):
    tree = "t"
    folder = _copy_of_results(tmp_path, without="demo.json")
    for name in ("frontier_roles_heldout.json", "frontier_roles_dev.json", "agent_traffic.json"):
        (folder / name).unlink(missing_ok=True)
    rows = report.headline_rows(folder, tree=tree)
    assert [r[-1] for r in rows] == ["[chain_ttft](#chain_ttft)"]
    _demo_file(folder / "demo.json", tree)
    task = json.loads((report.RESULTS / "frontier_gsm8k.json").read_text())
    task["arms"] = {"off": task["arms"]["off"], "fullshared_k0": task["arms"]["fullshared_k0"],
                    "default": {**task["arms"]["fullshared_r0.15"], "random_mix_kl_at_same_reuse": 0.006,
                                "teacher_forced_line_gap_ci95": {"top1_above": [-0.01, 0.02],
                                                                 "kl_below": [0.001, 0.003]}}}
    task["segment_tokens"] = {"n": 9, "median": 512, "p10": 400, "p90": 600}
    heldout = {"meta": {**task["meta"], "serving_digest": tree, "parts": {"t": "python -m benchmarks.frontier"}},
               "roles": "heldout", "tasks": {"retrieval_1k": task}}
    (folder / "frontier_roles_heldout.json").write_text(json.dumps(heldout))
    rows = report.headline_rows(folder, tree=tree)
    assert [r[-1].split("]")[0][1:] for r in rows] == ["chain_ttft", "demo", "frontier_roles_heldout"]
    demo_row = rows[1]
    assert "(1.40x); reuse 0.64 of 280 shared tokens" in demo_row[1] and demo_row[-2] == "fresh"
    assert "held-out roles" in rows[2][0] and "retrieval_1k (512-token segments, " in rows[2][2]
    assert "gap [-0.010, +0.020]" in rows[2][2] and rows[2][-2] == "fresh"
    text = report.render(folder, tree=tree)
    assert '## <a id="demo"></a>demo\n' in text and '<a id="frontier_roles_heldout"></a>frontier_roles_heldout\n' in text
