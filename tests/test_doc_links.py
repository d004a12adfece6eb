"""Every relative link of README.md, BENCHMARKS.md and the pages under docs/ resolves: the file
exists and, for a `#anchor`, the target page has a heading that GitHub gives that anchor."""

from __future__ import annotations

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "BENCHMARKS.md"] + sorted(
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")
)
_FENCED = re.compile(r"^```.*?^```", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """`text` without code blocks and code spans (a link-like string there is not a link)."""
    return _CODE.sub("", _FENCED.sub("", text))


def anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCED.sub("", text)):
        a = anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def links(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        return [m.group(1) for m in _LINK.finditer(_prose(f.read()))]


def test_anchor_follows_github():
    assert anchor("Eager `moe_apply_sharded`") == "eager-moe_apply_sharded"
    assert anchor("Deviceless accelerator compiles (H100, TPU v5e/v5p)") == (
        "deviceless-accelerator-compiles-h100-tpu-v5ev5p"
    )
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}
    assert links("README.md"), "the README links to its sections and pages"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not checked here
            continue
        path, _, frag = target.partition("#")
        dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else None
        dest = dest or os.path.join(ROOT, page)
        if not os.path.exists(dest):
            broken.append(f"{target}: no such file")
        elif frag and dest.endswith(".md"):
            with open(dest) as f:
                if frag not in anchors(f.read()):
                    broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page}:\n" + "\n".join(broken)
