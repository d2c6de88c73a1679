"""The project's own documentation: it ships in the repository (no file cites a path outside
it), the specification keeps its section numbers, every local link resolves, and the
extension guide's worked example is the shipped ``lru2`` cache, character for character."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: A path beside the checkout that a clone does not have (built in two parts so that this
#: file does not match itself).
OUTSIDE = "../" + "shared/"


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_file_cites_a_path_outside_the_repository() -> None:
    """No tracked file (text or not) mentions :data:`OUTSIDE`: a clone has only the repository."""
    needle = OUTSIDE.encode()
    bad = [str(p.relative_to(ROOT)) for p in _tracked()
           if p.is_file() and needle in p.read_bytes()]
    assert not bad, f"files citing {OUTSIDE} (outside the repository): {bad}"


def test_specification_keeps_its_section_numbers() -> None:
    """docs/algorithms.md has sections 0..12 in order: code cites them as "algorithms.md §N"."""
    text = (DOCS / "algorithms.md").read_text(encoding="utf-8")
    numbers = [int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.M)]
    assert numbers == list(range(13))


def test_every_local_markdown_link_resolves() -> None:
    """Each relative link ``](path)`` in README.md and docs/*.md names an existing file."""
    for md in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (md.parent / target).exists(), f"{md.name}: broken link {target}"


def _block_after(text: str, heading: str, lang: str) -> str:
    section = text[text.index(heading):]
    start = section.index(f"```{lang}\n") + len(lang) + 4
    return section[start:section.index("\n```", start) + 1]


def test_guide_example_is_the_shipped_policy() -> None:
    """docs/extending.md's LRU-2 file and YAML are src/moeexp/cache/lru2.py and
    conf/cache/lru2.yaml exactly, so the guide's example runs under the suite's tests."""
    guide = (DOCS / "extending.md").read_text(encoding="utf-8")
    assert _block_after(guide, "## 2. The file", "python") == \
        (ROOT / "src/moeexp/cache/lru2.py").read_text(encoding="utf-8")
    assert _block_after(guide, "## 3. The YAML", "yaml") == \
        (ROOT / "conf/cache/lru2.yaml").read_text(encoding="utf-8")
