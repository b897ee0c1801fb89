"""The README, benchmarks/README.md and docs/ name repository files in backticks and
links; every one of them must exist, so a renamed or deleted file cannot leave a page
pointing at nothing. Relative Markdown links in the README and docs/ must resolve too,
and a link's #anchor must be a heading of the page it points to. Reads files only."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
GUIDE = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]  # their links are checked with anchors
FOLDERS = ("emulator", "devices", "server", "models", "common", "reports", "scenarios", "tests", "benchmarks", "docs")
# `scenarios/s1_mnist.yaml`, `server/fcr.py:relate`, `docs/results/shift/` (not patterns or placeholders)
NAMED = re.compile(r"`(?:[^`\s]+ )*((?:" + "|".join(FOLDERS) + r")/[\w./-]*)[^`]*`")
EXAMPLES = {"scenarios/x.yaml", "scenarios/more/"}  # made-up names in the docs' examples
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)[^)]*\)")
# [text](target) with an optional "title"; the target may be a path, path#anchor or #anchor
MD_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def named_paths(page: Path) -> list[str]:
    text = page.read_text()
    return [p.rstrip(".") for p in NAMED.findall(text)] + [p for p in LINK.findall(text) if ":" not in p]


def prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `# comment` in bash is no heading)."""
    lines, fence = [], ""
    for line in page.read_text().splitlines():
        mark = line.strip()[:3]
        if fence:
            if line.strip().startswith(fence):
                fence = ""
        elif mark in ("```", "~~~"):
            fence = mark
        else:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page):
        if m := HEADING.match(line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")  # GitHub numbers repeated headings
            seen[s] = seen.get(s, 0) + 1
    return frozenset(out)


def test_the_pages_name_files():
    # the checks below have something to check
    assert len(named_paths(REPO / "README.md")) > 10
    assert sum(len(named_paths(p)) for p in PAGES) > 200
    assert sum(len(MD_LINK.findall("\n".join(prose(p)))) for p in GUIDE) > 30


def test_slugs_follow_github():
    assert slug("Dynamic clustering with FLT's defaults (CPU)") == "dynamic-clustering-with-flts-defaults-cpu"
    assert slug("A 5-minute tour") == "a-5-minute-tour"
    assert slug("flt relate") == "flt-relate"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_named_files_exist(page):
    missing = {p for p in named_paths(page) if not (REPO / p).exists() and not (page.parent / p).exists()}
    made_by_running = {p for p in missing if any(part.startswith(".") for part in p.split("/"))}  # caches
    broken = sorted(missing - EXAMPLES - made_by_running)
    assert not broken, f"{page.relative_to(REPO)} names files that do not exist: {broken}"


@pytest.mark.parametrize("page", GUIDE, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in MD_LINK.findall("\n".join(prose(page))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    assert not broken, f"{page.relative_to(REPO)} has broken links: {broken}"
