"""The README stays a user's page and the docs stay inside the repository.

The README is what a newcomer reads first: it must stay short (measurement history belongs in
docs/results.md) and list every doc. Every relative link in the README and docs/ must open a file of this
repository (never ../shared, which only the project's own machines have), and every #anchor a heading of the
file it points into. Code comments do not narrate benchmark runs, issues or commits.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
README_MAX_BYTES = 15_000

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
RUN_LOG = re.compile(r"\b[Rr]uns? [A-Z](?:[-–, ][A-Z])*\b(?![\w.])|\bissue #?\d+|\bcommit [0-9a-f]{7,40}\b")


def prose(text: str) -> str:
    """The text without fenced code blocks (a ``# comment`` in a bash block is not a heading)."""
    return FENCE.sub("", text)


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(INLINE_CODE.sub("", prose(path.read_text())))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (letters such as α kept), spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose(path.read_text())):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for target in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        if root != dest and root not in dest.parents:
            shared = (root.parent / "shared") in (dest, *dest.parents)
            problems.append(f"{target}: points {'into ../shared, ' if shared else ''}outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return [f"{path.relative_to(root)}: {p}" for p in problems]


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size:,} bytes (limit {README_MAX_BYTES:,}): measurement history goes to docs/results.md")


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repository(path: Path) -> None:
    assert broken_links(path) == []


def test_the_link_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The checks above can fail: a missing file, ../shared, an escape from the repo and a missing anchor."""
    assert links(REPO / "docs" / "results.md"), "docs/results.md has no links to check"
    assert slug("FuXi-α against its reference code") == "fuxi-α-against-its-reference-code"
    assert slug("`grstack bench serve`: relay-race serving") == "grstack-bench-serve-relay-race-serving"
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "DESIGN.md").write_text("# plan\n")
    (tmp_path / "outside.txt").write_text("")
    (root / "docs" / "results.md").write_text("# Results\n\n## Quality\n\n```\n## Not a heading\n```\n")
    page = root / "docs" / "page.md"
    page.write_text("[a](nope.md) [b](../../shared/DESIGN.md) [c](../../outside.txt) [d](results.md#no-such)\n"
                    "[e](results.md#not-a-heading) [ok](results.md#quality) [ok](https://example.com/x.md)\n"
                    "`[not a link](missing.md)`\n```\n[in code](missing.md)\n```\n")
    problems = broken_links(page, root)
    assert len(problems) == 5, problems
    assert "no such file" in problems[0] and "../shared" in problems[1] and "outside" in problems[2]
    assert "no heading #no-such" in problems[3] and "no heading #not-a-heading" in problems[4]


def test_readme_lists_every_doc() -> None:
    linked = {(REPO / t.partition("#")[0]).resolve() for t in links(README) if t.startswith("docs/")}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert missing == [], f"README's 'Where to go next' should link docs/{', docs/'.join(missing)}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_docs_do_not_point_at_the_projects_machines(path: Path) -> None:
    """Paths such as ../shared/data or /work/... exist only on this project's machines, not a user's."""
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if "../shared" in line or "/work/" in line]
    assert hits == []


def test_readme_and_code_comments_hold_no_run_logs() -> None:
    """Run letters, issue numbers and commit hashes belong in docs/results.md and the history, not here."""
    hits = []
    sources = [README, *(p for folder in ("runtime", "kernels", "operator") for p in (REPO / folder).rglob("*.py"))]
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if RUN_LOG.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert hits == []
