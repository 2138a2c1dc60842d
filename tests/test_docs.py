"""The docs stay true to the code: docs/architecture.md names every module
of zero_jax/ and models/ and no module that is gone, no page names a code
path that does not exist, every link between pages lands on a page and a
heading that exist, and the README stays a guide (at most 250 lines).

Links are checked as GitHub renders them: a heading's anchor is its text in
lower case, without punctuation, spaces turned into hyphens.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
ARCHITECTURE = DOCS / "architecture.md"
MODULE = re.compile(r"\b(?:zero_jax|models)/[\w/]*\w\.py\b")  # zero_jax/sharding/mesh.py
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
README_MAX_LINES = 250


def prose(text: str) -> str:
    """The text without its fenced code blocks (their '#' lines are no headings)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, as GitHub makes them."""
    out: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", prose(text), flags=re.M):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in out:  # a repeated heading gets -1, -2, ...
            n += 1
            slug = f"{base}-{n}"
        out.add(slug)
    return out


def package_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for top in ("zero_jax", "models")
            for p in (ROOT / top).rglob("*.py") if p.name != "__init__.py"}


def test_architecture_names_every_module_of_the_package():
    named = set(MODULE.findall(ARCHITECTURE.read_text()))
    missing = sorted(package_modules() - named)
    assert not missing, f"docs/architecture.md: add a line to the module map for {missing}"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_module_a_page_names_exists(page):
    gone = sorted({m for m in MODULE.findall(page.read_text()) if not (ROOT / m).is_file()})
    assert not gone, f"{page.relative_to(ROOT)} names modules that do not exist: {gone}"


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_every_link_lands_on_a_page_and_heading(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no {path}")
        elif anchor and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_readme_links_every_docs_page_and_stays_short():
    text = README.read_text()
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"(docs/{p.name}" not in text]
    assert not unlinked, f"README.md: link {unlinked}"
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines; move the detail to the "
                                       f"docs page it belongs on (at most {README_MAX_LINES})")


def test_the_stated_vocabulary_of_the_default_data_is_the_one_it_has(corpus):
    """The README and the data page give the default data's vocabulary; the
    plan prints the corpus's own, and the two must agree."""
    def near_stdlib(text: str) -> list[str]:
        at = text.index("standard library")
        return re.findall(r"vocabulary (\d+)", text[at - 200:at + 200])
    stated = {page.name: near_stdlib(page.read_text()) for page in (README, DOCS / "data.md")}
    assert stated == {"README.md": [str(corpus.vocab_size)], "data.md": [str(corpus.vocab_size)]}
