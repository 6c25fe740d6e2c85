"""Test helpers for engine runs: tiny configs, reward functions referenced by import path, metric readers."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from rloo_engine.config import RLOOConfig, build_config

REPO = Path(__file__).resolve().parents[2]


def repo_pythonpath() -> str:
    """PYTHONPATH for a child process: this checkout first, then whatever the test process had (the overlay of
    scripts/test_engine_on_transformers.sh), so children run the same transformers as the test."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

# Token ids 10..41 of the 320-token test tokenizer: about 10% of a random policy's samples.
TARGET_IDS = set(range(10, 42))


def target_token_fraction(completion_ids, **_):
    """Fraction of completion tokens in TARGET_IDS: dense enough for a tiny policy to learn in a few dozen steps."""
    return [sum(t in TARGET_IDS for t in ids) / max(len(ids), 1) for ids in completion_ids]


def failing_reward(**_):
    """A reward function whose service is down: it raises on every call."""
    raise ConnectionError("reward service at http://127.0.0.1:9 refused the connection")


def failing_reward_on_rank_1(completions, **_):
    """A reward function whose service is down for rank 1 alone; rank 0 scores every completion 1."""
    if os.environ.get("RANK") == "1":
        failing_reward()
    return [1.0] * len(completions)


TOPIC_OFFSET = {w: 2.0 * i for i, w in enumerate("the cat dog sat ran on mat tree red blue".split())}


def target_fraction_plus_prompt_offset(completion_ids, topic, **_):
    """target_token_fraction plus a large per-prompt constant (0..18, from the `topic` column).

    The leave-one-out baseline cancels the constant exactly; a missing baseline or groups that
    mix prompts turn it into noise that swamps the learning signal.
    """
    return [f + TOPIC_OFFSET[t] for f, t in zip(target_token_fraction(completion_ids), topic)]


async def async_length_reward(completions, **_):
    await asyncio.sleep(0)
    return [len(c) / 100 for c in completions]


def sometimes_none_reward(completions, **_):
    """None for every other completion: those rows are unscorable for this function."""
    return [None if i % 2 else 1.0 for i, _ in enumerate(completions)]


def never_scores(completions, **_):
    return [None] * len(completions)


def prompt_file(tmp_path: Path, n: int = 32, conversational: bool = False) -> Path:
    words = "the cat dog sat ran on mat tree red blue".split()
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / ("chat.jsonl" if conversational else "prompts.jsonl")
    with path.open("w") as fh:
        for i in range(n):
            text = " ".join(words[(i + j) % len(words)] for j in range(3))
            prompt = [{"role": "user", "content": text}] if conversational else text
            fh.write(json.dumps({"prompt": prompt, "topic": words[i % len(words)]}) + "\n")
    return path


def tiny_config(tmp_path: Path, model: Path, **overrides) -> RLOOConfig:
    values = dict(
        model_name_or_path=str(model),
        dataset_name=str(prompt_file(tmp_path)),
        reward_funcs=["tests.engine.helpers:target_token_fraction"],
        output_dir=str(tmp_path / "out"),
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=6,
        max_prompt_length=16,
        learning_rate=1e-3,
        beta=0.0,
        max_steps=4,
        logging_steps=1,
        save_steps=0,
        disable_tqdm=True,
        disable_dropout=True,  # TRL's default is false; tests compare exact log-probs, LoRA's dropout included
        seed=0,
    )
    values.update(overrides)
    return build_config(values)


def read_metrics(output_dir: str | Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line]


def trl_style_reply_length(completions, **_):
    """A reward written as TRL's docs write them for chat data: it reads completion[0]["content"]."""
    return [len(c[0]["content"]) / 10 for c in completions]


def train_until_crash(tmp_path: Path, model: Path, monkeypatch, step: int, **overrides) -> None:
    """Trains `tiny_config(tmp_path, model, **overrides)` with the injected crash after `step` (the process exit the
    engine's fault injection raises), and leaves the environment without it for the resumed run."""
    import pytest

    from rloo_engine.run.fault_injection import CRASH_ENV
    from rloo_engine.trainer import RLOOTrainer

    monkeypatch.setenv(CRASH_ENV, str(step))
    with pytest.raises(SystemExit):
        RLOOTrainer(tiny_config(tmp_path, model, **overrides)).train()
    monkeypatch.delenv(CRASH_ENV)


def slow_target_reward(completion_ids, **kwargs):
    """target_token_fraction, taking a second a call: steps long enough for a test to act between them."""
    import time

    time.sleep(1.0)
    return target_token_fraction(completion_ids)
