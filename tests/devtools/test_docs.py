"""The generated docs match the code: docs/CONFIGURATION.md and the upgrade checklist in docs/ARCHITECTURE.md."""

from __future__ import annotations

import dataclasses

from devtools import docs
from sglang_kvshare.config import GROUPS, KVShareConfig


def test_generated_docs_are_current():
    stale = [str(path) for path, text in docs.expected().items() if not path.exists() or path.read_text() != text]
    assert stale == [], "run: python -m devtools.docs"


def test_every_option_is_documented_in_its_group():
    text = docs.configuration_markdown()
    for f in dataclasses.fields(KVShareConfig):
        assert f.metadata["group"] in GROUPS, f.name
        assert f"`--kvshare-{f.name.replace('_', '-')}`" in text


def test_the_checklist_lists_every_target():
    from sglang_kvshare.server import sglang_targets as st

    text = docs.targets_markdown()
    assert all(t.path in text for t in st.all_targets())
