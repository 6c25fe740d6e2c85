"""docs/architecture.md's module map matches the tree: every package directory and every tracked module is named,
and every module it names exists."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rloo_engine", "tasks", "flows")


def tracked_modules() -> set[str]:
    out = subprocess.run(["git", "ls-files", "--", *PACKAGES], cwd=ROOT, capture_output=True, text=True, check=True)
    return {line for line in out.stdout.splitlines() if line.endswith(".py")}


def map_text() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return text[text.index("## Module map") :]


def test_every_tracked_module_is_in_the_map():
    text = map_text()
    missing = sorted(m for m in tracked_modules() if f"`{m}`" not in text)
    assert not missing, f"docs/architecture.md's module map lacks: {missing}"


def test_every_package_directory_is_in_the_map():
    packages = {str(Path(m).parent) for m in tracked_modules() if m.endswith("__init__.py")}
    missing = sorted(p for p in packages if f"`{p}/`" not in map_text())
    assert not missing, f"package directories with no section in docs/architecture.md: {missing}"


def test_the_map_names_no_module_that_is_gone():
    named = set(re.findall(r"`((?:rloo_engine|tasks|flows)/[\w/]+\.py)`", map_text()))
    gone = sorted(named - tracked_modules())
    assert not gone, f"docs/architecture.md names modules that are not in the tree: {gone}"
