"""The generated docs match the code: docs/CONFIGURATION.md and the upgrade checklist, docs/UPGRADE.md."""

from __future__ import annotations

import dataclasses

from devtools import docs
from sglang_kvshare.config import FLAG_FIELDS, GROUPS, RUNTIME_FIELDS, KVShareConfig


def test_generated_docs_are_current():
    stale = [str(path) for path, text in docs.expected().items() if not path.exists() or path.read_text() != text]
    assert stale == [], "run: python -m devtools.docs"


def test_every_setting_is_documented_in_its_section_with_its_flag():
    text = docs.configuration_markdown()
    for f in dataclasses.fields(KVShareConfig):
        assert f.metadata["group"] in GROUPS, f.name
        section = text[text.index(f"## {f.metadata['group']} ("):]
        row = next(line for line in section.splitlines() if line.startswith(f"| `{f.name}` |"))
        assert (f"`--kvshare-{f.name.replace('_', '-')}`" in row) == (f.name in FLAG_FIELDS)


def test_the_one_runtime_list_is_generated_and_the_docs_link_to_it():
    text = docs.configuration_markdown()
    listed = text[text.index("## Runtime settings"):].split("\n\n")[1]
    assert all(f"`{name}`" in listed for name in RUNTIME_FIELDS)
    for path in ("README.md", "docs/OPERATIONS.md", "docs/FIDELITY.md", "docs/ARCHITECTURE.md"):
        assert f"CONFIGURATION.md#{docs.RUNTIME_ANCHOR}" in (docs.ROOT / path).read_text(), path


def test_the_checklist_lists_every_target():
    from sglang_kvshare.server import sglang_targets as st

    text = docs.targets_markdown()
    assert all(t.path in text for t in st.all_targets())


def test_the_checklist_is_its_own_file_and_the_architecture_links_to_it():
    assert docs.UPGRADE in docs.expected()
    architecture = (docs.ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert "](UPGRADE.md)" in architecture
    assert "| SGLang method | why |" not in architecture  # the checklist is stated once, in UPGRADE.md
