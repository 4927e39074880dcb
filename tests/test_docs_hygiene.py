"""Users read README and docs/, not the project's history: no process words there or in code comments.

README, docs/ and every source file (comments and docstrings included) state
what is true now. Development rounds ("session 12"), tracker numbers ("issue
14") and dated timing logs belong to git log; a results table may name the
date of its measurement, and only docs/RESULTS.md (generated from the results
JSON) holds such tables.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300

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


def test_the_checks_catch_planted_words():
    for planted in ("measured in session 12", "see issue 14", "fixed for issue-13", "timed on 2026-12-01"):
        assert PROCESS_WORDS.search(planted) or DATE.search(planted), planted
