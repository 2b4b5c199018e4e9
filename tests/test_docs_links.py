"""The documentation's relative links resolve, and the README stays a landing page.

Every relative link (`[text](path)`, `![alt](path)`, `[label]: path`, `path#anchor`, `#anchor`) in README.md,
BENCHMARKS.md and every .md under docs/ must name an existing file or folder and, for an anchor into a .md
file, a heading of that file in GitHub's slug style. External links (any `scheme:`) are not checked.
The checker is tested on files written here with known good and broken links, and the slug function against
anchors GitHub gives.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
BENCHMARKS_MAX_LINES = 350  # a results page; detail goes to docs/benchmarks/

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documentation_files():
    return [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is None:
            yield number, line


def github_slug(heading_text):
    """The anchor GitHub gives a heading: rendered text, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading_text)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path):
    """Every anchor of a markdown file: its headings' slugs (-1, -2, ... for repeats) and HTML ids."""
    seen = {}
    found = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path):
    """(line number, target) of every link in a markdown file, outside code blocks and code spans."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        line = CODE_SPAN.sub("", line)
        targets = INLINE_LINK.findall(line) + REFERENCE_DEFINITION.findall(line)
        for target in targets:
            yield number, target.strip("<>")


def broken_links(path, root):
    """A message per relative link of `path` that names no file, or no heading of the file it names."""
    problems = []
    for number, target in links(path):
        if SCHEME.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not destination.exists():
            problems.append(f"{where}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{where}: no heading with anchor #{anchor} in {destination.relative_to(root)}")
    return problems


# ----------------------------------------------------------------------------------------- the repository


def test_every_relative_link_in_the_documentation_resolves():
    files = documentation_files()
    assert len(files) > 3  # README, BENCHMARKS and docs/ were all found
    problems = [problem for path in files for problem in broken_links(path, REPO)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_a_landing_page_of_at_most_150_lines():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/guides/"


def test_benchmarks_is_a_results_page_of_at_most_350_lines_linking_its_detail():
    lines = (REPO / "BENCHMARKS.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= BENCHMARKS_MAX_LINES, f"BENCHMARKS.md has {len(lines)} lines; move detail to docs/benchmarks/"
    linked = {(REPO / target.partition("#")[0]).resolve() for _, target in links(REPO / "BENCHMARKS.md")}
    assert set((REPO / "docs" / "benchmarks").glob("*.md")) <= linked


def test_readme_links_every_guide():
    linked = {
        (REPO / target.partition("#")[0]).resolve() for _, target in links(REPO / "README.md") if "guides/" in target
    }
    guides = set((REPO / "docs" / "guides").glob("*.md"))
    assert guides, "docs/guides/ holds no guide"
    assert guides <= linked, f"guides not linked from README.md: {sorted(g.name for g in guides - linked)}"


# ----------------------------------------------------------------------------------------- the checker


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [  # anchors GitHub renders for these headings
        ("Tested here, and not", "tested-here-and-not"),
        ("The NTK-by-parts / YaRN ramp", "the-ntk-by-parts--yarn-ramp"),
        ("Perplexity protocol (`ctxext eval`)", "perplexity-protocol-ctxext-eval"),
        ("Comparison report (docs/comparison.md)", "comparison-report-docscomparisonmd"),
        (
            "Attention-level methods: training memory (forward + backward)",
            "attention-level-methods-training-memory-forward--backward",
        ),
        ("`ctxext check` on the CPU", "ctxext-check-on-the-cpu"),
        ("See [the guide](guides/a.md) now", "see-the-guide-now"),
        ("ntk_mixed and θ'", "ntk_mixed-and-θ"),
    ],
)
def test_github_slug_matches_githubs_anchors(heading, anchor):
    assert github_slug(heading) == anchor


def test_the_checker_reports_a_missing_file_and_a_missing_anchor_and_nothing_else(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "guide.md").write_text('# Guide\n\n## Options\n\n## Options\n\n<a id="custom"></a>\n')
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Same page\n\n"
        "[ok](sub/guide.md) [ok](sub/guide.md#options-1) [ok](sub/guide.md#custom) ![ok](picture.png)\n"
        "[ok](#same-page) [ok](sub/) [ok](https://example.com/missing.md) `[code](missing.md)`\n"
        "[gone](sub/missing.md)\n"
        "[bad anchor](sub/guide.md#options-2)\n"
        "[bad local anchor](#no-such-heading)\n"
        "[def]: ./gone-too.md\n"
        "```\n[in a fence](fenced-missing.md)\n# not a heading\n```\n"
    )
    problems = broken_links(page, tmp_path)
    assert [problem.split(": ")[1] for problem in problems] == [
        "sub/missing.md",
        "sub/guide.md#options-2",
        "#no-such-heading",
        "./gone-too.md",
    ], problems
    assert "no such file" in problems[0] and "no heading with anchor #options-2" in problems[1]
    assert "not-a-heading" not in anchors(page)
