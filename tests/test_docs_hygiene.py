"""Users read README and docs/, not the project's history: no process words there or in code comments.

README, docs/ and every source file (comments and docstrings included) state
what is true now. Development rounds ("session 12"), tracker numbers ("issue
14") and dated timing logs belong to git log; a results table may name the
date of its measurement, and only docs/RESULTS.md (generated from the results
JSON) holds such tables. The reference docs keep to a line budget, and every
relative link in README and docs/ reaches a file and heading that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
# docs/*.md are user reference (study logs live in docs/research/); docs/RESULTS.md is generated and not counted.
DOCS_MAX_LINES = 1350

PROCESS_WORDS = re.compile(r"\bsessions? \d+|\bs1\d\b|\bissues? #?\d+|\bissue-\d+|before this change",
                           re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
GENERATED = {ROOT / "docs" / "RESULTS.md"}  # may name the date of each measurement
# README's headline table is generated from the results too (between these markers): it names dates as well.
README_GENERATED = re.compile(r"<!-- headline-results:begin -->.*?<!-- headline-results:end -->", re.DOTALL)


def _texts() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "data" / "README.md"]
    for folder in ("sglang_kvshare", "kernels", "frontend", "benchmarks", "devtools", "tests", "examples",
                   "scripts"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")
                        and "results" not in p.relative_to(ROOT).parts)
    return [f for f in files if f.exists() and f != Path(__file__).resolve()]


@pytest.mark.parametrize("path", _texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_process_words(path):
    text = path.read_text(errors="replace")
    if path == ROOT / "README.md":
        text = README_GENERATED.sub("", text)
    hits = [f"{n}: {line.strip()[:120]}" for n, line in enumerate(text.splitlines(), 1)
            if PROCESS_WORDS.search(line) or (path not in GENERATED and DATE.search(line))]
    assert hits == []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


def test_the_reference_docs_stay_within_their_budget():
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p not in GENERATED]
    lines = sum(len(p.read_text().splitlines()) for p in docs)
    assert lines <= DOCS_MAX_LINES, f"docs/*.md have {lines} lines; state each fact once, move studies to docs/research/"


LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading's anchor, and every explicit ``<a id="...">`` (a generated heading that carries a mark)."""
    text = FENCE.sub("", path.read_text())
    return ({_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}
            | set(re.findall(r'<a id="([^"]+)"></a>', text)))


def _broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, fragment = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(target)
        elif fragment and resolved.suffix == ".md" and fragment not in _anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert _broken_links(path) == []


def test_the_link_check_catches_a_moved_file_and_a_renamed_heading(tmp_path):
    (tmp_path / "A.md").write_text("# Title\n\n## Which setting to run\n")
    page = tmp_path / "B.md"
    page.write_text("[ok](A.md#which-setting-to-run) [gone](OLD.md) [renamed](A.md#settings)\n```\n[code](X.md)\n```\n")
    assert _broken_links(page) == ["OLD.md", "A.md#settings"]


def test_the_checks_catch_planted_words():
    for planted in ("measured in session 12", "see issue 14", "fixed for issue-13", "timed on 2026-12-01"):
        assert PROCESS_WORDS.search(planted) or DATE.search(planted), planted
