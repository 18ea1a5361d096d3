"""docs/README.md is the docs' index: every page of docs/ is listed there, and every page it links exists; the
front page stays short enough to read in five minutes (issue 49: at most 250 lines) and links the index."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_index_lists_every_page_and_only_pages_that_exist():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w.]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, f"pages missing from docs/README.md: {sorted(pages - linked)}"
    assert linked <= pages, f"docs/README.md links pages that do not exist: {sorted(linked - pages)}"


def test_the_front_page_is_short_and_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(((?:docs|benchmarks|examples)/[^)#]+)\)", readme):
        assert (ROOT / target).exists(), target
