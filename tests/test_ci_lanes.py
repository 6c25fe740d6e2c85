"""CI's lanes: the engine test files the oldest-transformers run picks (scripts/engine_tests_on_oldest_transformers.txt)
name every engine test file once, and each node it runs exists; the tests lane 2 takes from the main lane
(scripts/ci_second_lane_tests.txt) exist, and .ci/run's main lane deselects exactly those."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "scripts" / "engine_tests_on_oldest_transformers.txt"
SECOND_LANE = ROOT / "scripts" / "ci_second_lane_tests.txt"


def _lines(path: Path) -> list[list[str]]:
    """The words of each line of a list file that has any, comments (`#` on) left out."""
    return [words for line in path.read_text().splitlines() if (words := line.split("#")[0].split())]


def _entries() -> list[tuple[str, str]]:
    return [(words[0], words[1]) for words in _lines(LIST)]


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


def _collected(*args: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]  # 5: every test deselected
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_main_lane_deselects_what_lane_2_runs_and_nothing_else():
    moved = [words[0] for words in _lines(SECOND_LANE)]
    assert moved, f"{SECOND_LANE.name} lists no test"
    # .ci/run's own lines that read the list and build the main lane's arguments, run as CI runs them
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    start = next(i for i, line in enumerate(ci) if line.startswith("mapfile -t moved"))
    end = next(i for i in range(start, len(ci)) if ci[i].startswith("for node in"))
    script = "\n".join([*ci[start : end + 1], 'printf "%s\\n" "${moved[@]}"; printf "%s\\n" "${main_args[@]}"'])
    printed = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = printed.splitlines()
    assert lines[: len(moved)] == moved
    assert lines[len(moved) :] == [arg for node in moved for arg in ("--deselect", node)]
    lane2 = _collected(*moved)
    for node in moved:
        assert any(t == node or t.startswith(node + "::") for t in lane2), f"{SECOND_LANE.name}: {node} collects no test"
    # the main lane's arguments over the same files leave none of lane 2's tests, and keep the files' others
    files = sorted({node.split("::")[0] for node in moved})
    kept = _collected(*files, *lines[len(moved) :])
    assert not set(kept) & set(lane2), sorted(set(kept) & set(lane2))
    assert set(kept) | set(lane2) == set(_collected(*files))
