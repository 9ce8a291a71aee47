"""The documents' links: every relative link and image in README.md and docs/*.md names a file
of the repository, and every #anchor a heading of the page it points to (GitHub's heading ids).
The README stays short enough to read in ten minutes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.source_tree  # reads the source tree (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
README_LINES = 350


def _heading_ids(text: str) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces to '-'."""
    ids = set()
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        title = re.sub(r"[^\w\- ]", "", title)
        ids.add(title.replace(" ", "-"))
    return ids


def _links(text: str) -> list[str]:
    """Link targets outside fenced code blocks and inline code."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return out


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    text = doc.read_text()
    bad = []
    for target in _links(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _heading_ids(file.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not bad, f"{doc.name}: " + "; ".join(bad)


def test_the_docs_exist_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for name in ("design.md", "performance.md"):
        assert (ROOT / "docs" / name).is_file(), name
        assert f"docs/{name}" in readme, f"the README does not link docs/{name}"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES})"


def test_the_link_check_catches_a_broken_link(tmp_path):
    """The checker itself: a link to a missing file and to a missing heading are found."""
    page = "# Title\n\n## A section\n\n[ok](#a-section) [bad](#nowhere) [gone](missing.md)\n"
    targets = _links(page)
    assert targets == ["#a-section", "#nowhere", "missing.md"]
    ids = _heading_ids(page)
    assert "a-section" in ids and "nowhere" not in ids


def test_every_figure_the_documents_show_is_drawn_by_the_script(tmp_path):
    """docs/figures.py draws exactly the figures README.md and docs/ show, from the repository's
    records and layouts (so none is drawn by hand or left stale by a renamed record)."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("figures", ROOT / "docs" / "figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    assert figures.main(["--out", str(tmp_path)]) == 0
    drawn = {p.name for p in tmp_path.glob("*.png")}
    shown = {Path(t).name for doc in DOCUMENTS for t in _links(doc.read_text())
             if t.endswith(".png")}
    assert shown == drawn, (shown, drawn)
    for name in drawn:
        assert (tmp_path / name).stat().st_size > 10_000, name
