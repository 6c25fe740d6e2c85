"""CI's lanes: the engine test files the oldest-transformers run picks (scripts/engine_tests_on_oldest_transformers.txt)
name every engine test file once, and each node it runs exists."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "engine_tests_on_oldest_transformers.txt"


def _entries() -> list[tuple[str, str]]:
    lines = [line.split("#")[0].split() for line in LIST.read_text().splitlines()]
    return [(words[0], words[1]) for words in lines if words]


def test_every_engine_test_file_is_placed_once_run_or_not():
    entries = _entries()
    assert {kind for kind, _ in entries} <= {"run", "not"}, entries
    placed = [(kind, target.split("::")[0]) for kind, target in entries]
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests" / "engine").glob("test_*.py"))
    unplaced = [f for f in files if f not in {name for _, name in placed}]
    assert not unplaced, f"{LIST.name}: place each of {unplaced} on a `run` or a `not` line"
    missing = sorted({name for _, name in placed} - set(files))
    assert not missing, f"{LIST.name} names {missing}, which do not exist"
    whole = [name for kind, name in placed if kind == "run"] + [name for kind, name in placed if kind == "not"]
    doubled = sorted({name for name in whole if whole.count(name) > 1} - _partly_run(entries))
    assert not doubled, f"{LIST.name}: {doubled} are listed more than once"


def _partly_run(entries) -> set[str]:
    """Files of which `run` names single tests (file::test) while `not` names the file: the rest stays out."""
    return {target.split("::")[0] for kind, target in entries if kind == "run" and "::" in target}


def test_the_run_lines_collect_tests():
    targets = [target for kind, target in _entries() if kind == "run"]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *targets],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert collected == {t.split("::")[0] for t in targets}, "a `run` line collects no test"
