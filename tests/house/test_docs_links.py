"""The README stays short and its links (and the docs pages' links) resolve.

The README is at most 250 lines and opens with its Quick start, whose two shell blocks set up and
run the main job and the tests; the tests' command is the one CI runs (`.ci/run`). Every relative
link in README.md and docs/*.md names a file of the repository and, with `#anchor`, a heading of
that file (GitHub's anchor rules). Every docs page but the design notes opens with the commands
that regenerate its numbers.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_README_LINES = 250
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced blocks and inline code (links there are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    anchors = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def broken_links(path: Path) -> list[str]:
    """Every relative link of ``path`` (a Markdown file) whose file or anchor does not exist."""
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(
                f"{target} (no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})"
            )
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading with anchor #{anchor})")
    return bad


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(REPO)}: broken links: {bad}"


def test_broken_links_are_found(tmp_path):
    """The check itself can fail: a missing file and a missing anchor are both reported."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [ok](#page) [web](https://example.org/x)\n"
        "[gone](missing.md) [anchor](other.md#nope) `[code](not-a-link.md)`\n"
        "```bash\n[in a block](also-not.md)\n```\n"
    )
    assert [b.split(" ")[0] for b in broken_links(page)] == ["missing.md", "other.md#nope"]


def test_slug_follows_github():
    assert _slug("Real execution (`executor=dist`) and the GPU check") == (
        "real-execution-executordist-and-the-gpu-check"
    )
    assert _slug("Which orderings survive the constants' uncertainty") == (
        "which-orderings-survive-the-constants-uncertainty"
    )


def _quick_start_blocks(readme: str) -> list[str]:
    start = readme.index("## Quick start")
    end = readme.find("\n## ", start + 1)
    return re.findall(r"^```bash\n(.*?)^```", readme[start:end], re.S | re.M)


def test_readme_is_short_and_opens_with_the_quick_start():
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    )
    sections = [line for line in lines if line.startswith("## ")]
    assert sections and sections[0] == "## Quick start", f"first section is {sections[:1]}"
    blocks = _quick_start_blocks(readme)
    assert len(blocks) == 2, f"Quick start has {len(blocks)} shell blocks, not 2"
    main_job, tests = blocks
    assert "flashcp-run -m experiment=fig5" in main_job
    assert tests.strip().splitlines()[-1] == "python -m pytest -q"


def test_ci_runs_the_readme_test_command():
    """CI installs the extras the Quick start's test block installs and runs its last command."""
    readme = (REPO / "README.md").read_text()
    tests = _quick_start_blocks(readme)[1].strip().splitlines()
    ci = [line.split(" #")[0].strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert tests[-1] in ci, f"`{tests[-1]}` is not a command of .ci/run"
    extras = re.findall(r'-e "(\.\[[^\]]*\])"', "\n".join(tests))
    ci_extras = re.findall(r'-e "(\.\[[^\]]*\])"', "\n".join(ci))
    assert extras and extras == ci_extras, f"README installs {extras}, .ci/run {ci_extras}"
    torch = re.findall(r"torch==[0-9.]+", "\n".join(tests))
    assert torch and torch == re.findall(r"torch==[0-9.]+", "\n".join(ci))


@pytest.mark.parametrize(
    "page",
    [p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "design.md"],
    ids=lambda p: p.name,
)
def test_docs_page_opens_with_its_commands(page):
    """After its title, a docs page starts with the shell block that regenerates its numbers."""
    body = [line for line in page.read_text().splitlines()[1:] if line.strip()]
    assert body and body[0] == "```bash", f"{page.name} opens with {body[:1]}, not a ```bash block"
