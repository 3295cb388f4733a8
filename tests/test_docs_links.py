"""The documentation's links resolve, and README stays a newcomer's page.

README.md and docs/*.md: each relative link points at an existing file and each ``#anchor`` at a heading of its
target, slugged as GitHub slugs it. External links (``http:``, ``https:``, ``mailto:``) are not fetched. README
is short and shows the two commands (the demo, and the test command CI runs through .ci/run)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 120

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), the target up to an optional "title"; [text][ref] with its [ref]: target.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)=\"([^\"]+)\"", re.IGNORECASE)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def prose_lines(text: str, inline_code: bool = False) -> list[str]:
    """The page's lines outside fenced code blocks, inline code blanked unless asked for.

    A link in code is an example, not a link; a heading's code is part of its anchor."""
    lines, fenced = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if fenced is None and match:
            fenced = match.group(1)
        elif fenced is not None:
            if line.strip().startswith(fenced):
                fenced = None
        else:
            lines.append(line if inline_code else INLINE_CODE.sub("", line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text.

    The rendered text (no code marks, emphasis or link targets), lower-cased, every character but letters, digits,
    marks, ``_``, ``-`` and spaces dropped, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(
        char for char in text.lower()
        if char in " -_" or unicodedata.category(char)[0] in "LMN"
    )
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page, a repeated one numbered as GitHub numbers it (``x``, ``x-1``, ``x-2``)."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(page.read_text(), inline_code=True):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number among the prose lines, target) of every link on a page."""
    found = []
    for number, line in enumerate(prose_lines(page.read_text()), start=1):
        for pattern in (INLINE_LINK, HTML_LINK):
            found += [(number, target) for target in pattern.findall(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append((number, definition.group(1)))
    return found


def broken(page: Path, target: str) -> str | None:
    """Why a link of a page does not resolve, or None."""
    if not target or EXTERNAL.match(target):
        return None
    path_part, _, anchor = target.partition("#")
    resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
    if not resolved.exists():
        return f"no file {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved}"
    if anchor and resolved.suffix == ".md":
        if unquote(anchor) not in anchors(resolved):
            return f"no heading #{anchor} in {resolved.relative_to(REPO)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    problems = [f"{target}: {why}" for _, target in links(page) if (why := broken(page, target))]
    assert not problems, "\n".join(problems)


def test_the_slugs_are_githubs():
    assert github_slug("0. APIs, the checkpoint bucket, roles, TPU capacity") == (
        "0-apis-the-checkpoint-bucket-roles-tpu-capacity"
    )
    assert github_slug("4. The VMs' service account") == "4-the-vms-service-account"
    assert github_slug("TpuSliceCreateOperator / TpuSliceDeleteOperator") == (
        "tpuslicecreateoperator--tpuslicedeleteoperator"
    )
    assert github_slug("The registry: `models.yaml`") == "the-registry-modelsyaml"
    assert github_slug("What's where") == "whats-where"


def test_a_broken_link_or_anchor_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "other.md").write_text("# Other\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#same-1) [self](#page) [gone](missing.md) [bad](other.md#same-2) "
        "[web](https://example.com/x#y)\n\n```md\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n"
    )
    assert [(target, broken(page, target)) for _, target in links(page)] == [
        ("other.md#same-1", None),
        ("#page", None),
        ("missing.md", "no file missing.md"),
        ("other.md#same-2", "no heading #same-2 in other.md"),
        ("https://example.com/x#y", None),
    ]


def test_the_readme_is_short_and_shows_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, len(text.splitlines())
    blocks = re.findall(r"^```bash\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    # .ci/run runs scripts/test, README's test command; the demo is the newcomer's first command.
    assert "./scripts/demo" in commands and "./scripts/test" in commands, commands


def test_the_google_cloud_page_shows_the_dag_file_the_readme_shows():
    """tests/test_wheel.py checks README's DAG file against the wheel; the full page carries the same file."""
    def python_blocks(page: Path) -> list[str]:
        found = re.findall(r"^\s*```python\n(.*?)^\s*```", page.read_text(), flags=re.MULTILINE | re.DOTALL)
        return ["\n".join(line.strip() for line in block.splitlines()) for block in found]

    [readme_dag_file] = [block for block in python_blocks(README) if "build_reaper_dag" in block]
    assert readme_dag_file in python_blocks(REPO / "docs" / "google-cloud.md")
