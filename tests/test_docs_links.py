"""Every relative link in README.md and docs/ reaches a file, and every anchor a heading there.

`mkdocs build --strict` checks the site's own pages; this also covers the README (read on GitHub)
and links out of the docs into the repository. An anchor matches a heading as MkDocs spells its id
(Python-Markdown's `toc`: runs of spaces and hyphens become one hyphen) or as GitHub does (each
space a hyphen), so a link written for either reader passes.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where brackets are not links."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _heading_text(raw: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", raw)  # a link's text
    return re.sub(r"[`*]", "", text)


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose_lines(path):
        heading = HEADING.match(line)
        if not heading:
            continue
        text = unicodedata.normalize("NFKD", _heading_text(heading.group(1)))
        plain = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
        for slug in (re.sub(r"[-\s]+", "-", plain), plain.replace(" ", "-")):
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}_{count}")
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _prose_lines(path: Path) -> list[str]:
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M).split("\n")


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_and_anchors_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, broken


def test_the_link_finder_sees_links():
    readme_links = links(ROOT / "README.md")
    assert "docs/getting-started.md" in readme_links
    assert "adaptive-eviction-eviction-adaptive" in anchors(ROOT / "docs/cache.md")
