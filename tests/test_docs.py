"""docs/architecture.md stays a true map: every module listed, every listed file present;
docs/benchmarks.md's contents list every section it has, and nothing else."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAP = (REPO / "docs" / "architecture.md").read_text()
BENCHMARKS = (REPO / "docs" / "benchmarks.md").read_text()


def tracked_modules() -> set[str]:
    files = subprocess.run(["git", "ls-files", "*.py", "*.proto"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    return {f for f in files
            if not f.startswith(("splitspec/v1/", "tests/test_")) and not f.endswith("__init__.py")
            and f not in ("tests/conftest.py",)}


def test_every_module_is_on_the_map():
    listed = set(re.findall(r"`([\w/]+\.(?:py|proto))`", MAP))
    missing = sorted(tracked_modules() - listed)
    assert not missing, f"add these to docs/architecture.md: {missing}"


def test_every_file_on_the_map_exists():
    listed = set(re.findall(r"`([\w/.]+\.(?:py|proto))`", MAP))
    absent = sorted(p for p in listed if not (REPO / p).exists() and "/" in p)
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_benchmarks_contents_link_every_section():
    headings = re.findall(r"^## (.+)$", BENCHMARKS, flags=re.MULTILINE)
    sections = [h for h in headings if h != "Contents" and not h.startswith("Where each aim")]
    contents = BENCHMARKS.split("\n## Contents\n", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"\]\(#([\w-]+)\)", contents)
    anchors = [github_anchor(h) for h in sections]
    assert len(set(anchors)) == len(anchors), "two sections of docs/benchmarks.md share an anchor"
    missing = [f"- ...: [...](#{a})" for a in anchors if a not in linked]
    assert not missing, "add to docs/benchmarks.md's Contents:\n" + "\n".join(missing)
    stale = sorted(set(linked) - set(anchors))
    assert not stale, f"docs/benchmarks.md's Contents link sections it no longer has: {stale}"
    assert linked == anchors, "docs/benchmarks.md's Contents are not in the file's order"
