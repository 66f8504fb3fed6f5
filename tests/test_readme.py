"""The README is a front door, and the manual's links hold: README.md stays short (at most 200 lines, no line outside a
code fence over 200 characters), and every relative link in README.md and docs/*.md names a file that exists and,
with an ``#anchor``, a heading of that file (GitHub's slugs)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = 200
MAX_WIDTH = 200

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the target ends at whitespace (a title may follow) or the closing bracket.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif match.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: the rendered text lowercased, every character but letters, digits, '_', '-'
    and spaces removed, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    """Every anchor the page's headings give, with GitHub's -1, -2 ... suffixes for repeated ones."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link outside code fences and code spans; link text may wrap."""
    text = path.read_text()
    kept = dict(prose_lines(text))
    lines = [CODE_SPAN.sub("", kept[n]) if n in kept else "" for n in range(1, len(text.splitlines()) + 1)]
    prose = "\n".join(lines)
    links = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        if not EXTERNAL.match(target):
            links.append((prose.count("\n", 0, match.start(1)) + 1, target))
    return links


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """One line per relative link of the page whose file is missing or whose anchor names no heading there."""
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not linked.exists():
            problems.append(f"{where}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{where}: no heading with that anchor in {linked.relative_to(root)}")
    return problems


def test_readme_is_at_most_200_lines():
    count = len(README.read_text().splitlines())
    assert count <= MAX_LINES, f"README.md has {count} lines; move detail into docs/ (at most {MAX_LINES})"


def test_readme_has_no_line_over_200_characters_outside_code():
    long = [f"line {n}: {len(line)} characters" for n, line in prose_lines(README.read_text()) if len(line) > MAX_WIDTH]
    assert not long, f"README.md lines over {MAX_WIDTH} characters outside code fences: {long}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """The slug rules on this manual's own heading shapes, and each check failing on a page that breaks it."""
    assert github_slug("FSDP2 and the model's output") == "fsdp2-and-the-models-output"
    assert github_slug("On one GPU: `make demo-lm-gpu`") == "on-one-gpu-make-demo-lm-gpu"
    assert github_slug("Gradient sums in fp32 vs bf16 (`parallel.grad_reduce_dtype`, issue 66)") == (
        "gradient-sums-in-fp32-vs-bf16-parallelgrad_reduce_dtype-issue-66"
    )
    assert github_slug("Hugging Face tokenizers (`tokenizer.type=hf`)") == "hugging-face-tokenizers-tokenizertypehf"

    target = tmp_path / "target.md"
    target.write_text("# Title\n\n## A section\n\n```bash\n# not a heading\n```\n\n## A section\n")
    assert anchors(target) == {"title", "a-section", "a-section-1"}
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](target.md#a-section) [ok](target.md#a-section-1) [ok](#local) [web](https://example.com/x#y)\n"
        "`[in code](missing.md)`\n```\n[in a fence](missing.md)\n```\n## Local\n"
        "[gone](missing.md) [bad anchor](target.md#not-a-heading) [fenced heading](target.md#not-a-heading-1)\n"
        "[a link whose text\nwraps](missing.md#x)\n"
    )
    assert [problem.split(": ", 1)[1] for problem in broken_links(page, tmp_path)] == [
        "missing.md: no such file",
        f"target.md#not-a-heading: no heading with that anchor in {target.name}",
        f"target.md#not-a-heading-1: no heading with that anchor in {target.name}",
        "missing.md#x: no such file",
    ]
    wide = "x" * (MAX_WIDTH + 1)
    assert [n for n, line in prose_lines(f"{wide}\n```\n{wide}\n```\nok\n") if len(line) > MAX_WIDTH] == [1]
