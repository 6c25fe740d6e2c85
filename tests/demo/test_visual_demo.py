"""The visual demo (issue 49): docs/demo.md's command, as a user runs it, ends with a tiny LLaVA that names the square's
colour more often than its SFT policy did, judged by the hidden rule on held-out pictures (visual-demo-command).
The smoke run checks the same code path in seconds; the rule itself is checked against pictures whose colour is
known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rloo_engine.demo import visual_task as task

REPO = Path(__file__).resolve().parents[2]


def documented_command() -> list[str]:
    text = (REPO / "docs" / "demo.md").read_text()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("python -m rloo_engine.demo.visual_demo")]
    return line.split("#")[0].split()


def run(out: Path, *extra: str) -> dict:
    argv = [sys.executable, *documented_command()[1:]]
    argv[argv.index("--out") + 1] = str(out)
    proc = subprocess.run([*argv, *extra], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def test_the_rule_reads_the_colour_from_the_pixels():
    for k, colour in enumerate(list(task.COLOURS) * 5):
        assert task.square_colour(task.picture(colour, seed=k)) == colour
    assert task.gold_score("the square is red.", "red") == 1.25
    assert task.gold_score("the square is red or blue", "red") == -1.0
    assert task.gold_score("it is", "red") == -1.0  # naming no colour is no safe way out of looking
    rewards = task.gold_reward([[{"role": "assistant", "content": "it is blue."}]], [task.picture("blue", 3)])
    assert rewards == [1.25]  # TRL's conversational completions and the dataset's image column


def test_the_smoke_run_goes_through_sft_rloo_and_the_judge(tmp_path):
    summary = run(tmp_path / "visual", "--smoke")
    assert set(summary) >= {"sft", "policy", "win_rate_vs_sft", "examples"}
    assert (tmp_path / "visual" / "rloo" / "final" / "processor_config.json").is_file()


def test_the_documented_visual_demo_learns_to_look(tmp_path):
    summary = run(tmp_path / "visual")
    sft, policy = summary["sft"], summary["policy"]
    assert sft["right_colour"] < 0.5  # SFT guesses: its data names the right colour half the time
    assert policy["right_colour"] >= sft["right_colour"] + 0.25, summary
    assert policy["gold_score"] > sft["gold_score"] + 0.4, summary
    assert summary["win_rate_vs_sft"] > 0.6, summary
