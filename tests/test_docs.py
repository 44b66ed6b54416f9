"""The README a newcomer reads stays short, and every relative link in it and in docs/*.md leads somewhere: the file
exists and an #anchor names one of its headings (GitHub's rule for a heading's anchor)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"`[^`]*`")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading).strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file; a repeated one also as anchor-1, anchor-2, ... as GitHub numbers
    them."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = anchor(match.group(1))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of a page that lead nowhere, each with why."""
    broken = []
    for line in prose(page.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):  # a link inside a code span is text
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                continue
            file_part, _, fragment = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{target}: no heading with the anchor #{fragment} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the reference belongs in docs/ pages"


def linked_pages(page: Path) -> set[Path]:
    return {(page.parent / target.partition("#")[0]).resolve() for line in prose(page.read_text())
            for target in LINK.findall(CODE_SPAN.sub("", line))
            if target.partition("#")[0].endswith(".md") and not re.match(r"^[a-z][a-z0-9+.-]*:", target)}


def test_every_docs_page_is_reached_from_the_readme() -> None:
    """The reference lives in docs/ pages that a reader finds: each is linked from the README or from a page it
    links."""
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page not in reached and page.exists():
            reached.add(page)
            todo.extend(linked_pages(page))
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in reached) == []


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    command = "-m pytest -q -n 2"
    readme = (ROOT / "README.md").read_text()
    assert f"python {command}" in readme
    assert any(line.startswith(f"python3 {command}") for line in (ROOT / ".ci" / "run").read_text().splitlines())


def test_the_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Title\n\n## Two `words` here\n\n## Two words here\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#title) [ok](a.md#two-words-here-1) [ok](https://x.org/nothing) [self](#top)\n"
                    "```\n[in code](missing.md)\n```\n`[span](missing.md)`\n[gone](missing.md) [bad](a.md#nope)\n"
                    "# Top\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "a.md#nope"]
    assert anchors(tmp_path / "a.md") == {"title", "two-words-here", "two-words-here-1"}
