"""The README, benchmarks/README.md and docs/ name repository files in backticks and
links; every one of them must exist, so a renamed or deleted file cannot leave a page
pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FOLDERS = ("emulator", "devices", "server", "models", "scenarios", "tests", "benchmarks", "docs")
# `scenarios/s1_mnist.yaml`, `server/fcr.py:relate`, `docs/results/shift/` (not patterns or placeholders)
NAMED = re.compile(r"`(?:\S+ )*((?:" + "|".join(FOLDERS) + r")/[\w./-]*)[^`]*`")
EXAMPLES = {"scenarios/x.yaml", "scenarios/more/"}  # made-up names in the README's examples
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)[^)]*\)")


def named_paths(page: Path) -> list[str]:
    text = page.read_text()
    return [p.rstrip(".") for p in NAMED.findall(text)] + [p for p in LINK.findall(text) if ":" not in p]


def test_the_pages_name_files():
    assert len(named_paths(REPO / "README.md")) > 20  # the check below has something to check


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_named_files_exist(page):
    missing = {p for p in named_paths(page) if not (REPO / p).exists() and not (page.parent / p).exists()}
    made_by_running = {p for p in missing if any(part.startswith(".") for part in p.split("/"))}  # caches
    broken = sorted(missing - EXAMPLES - made_by_running)
    assert not broken, f"{page.relative_to(REPO)} names files that do not exist: {broken}"
