"""Helpers of the evaluation tests: the small eval set, config values, and python-judge rules.

The eval set is built so that the fake server's "sensible" rule (more "good", then longer) gives
known answers: the policy beats the references on 7 of 10 prompts, the SFT model on 4 of 10, and
policy vs SFT is 3 wins, 4 losses and 3 prompts where the rule cannot separate the answers (so
the server answers "A" in both orders: an inconsistent pair, a tie).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

API_KEY = "sk-test-7f3a9c2e51d04b8e-never-log-me"
API_KEY_ENV = "RLOO_TEST_JUDGE_KEY"
N_PROMPTS = 10


@dataclass
class EvalFiles:
    root: Path
    prompts: Path
    policy: Path
    sft: Path
    references: dict[str, str]  # prompt text -> reference
    policy_texts: dict[str, str]
    sft_texts: dict[str, str]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def make_eval_files(root: Path, n: int = N_PROMPTS) -> EvalFiles:
    prompts = [f"Post {i}: my neighbour's cat keeps sitting on the mat under tree {i}. TL;DR:" for i in range(n)]
    references = {p: f"reference summary of post {i}" for i, p in enumerate(prompts)}
    policy = {p: (f"a good summary {i}" if i % 10 < 7 else "bad") for i, p in enumerate(prompts)}
    sft = {p: (f"good sft summary {i}" if i % 10 < 4 else "meh") for i, p in enumerate(prompts)}
    return EvalFiles(
        root=root,
        prompts=write_jsonl(root / "prompts.jsonl", [{"prompt": p, "reference": references[p]} for p in prompts]),
        policy=write_jsonl(root / "policy.jsonl", [{"prompt": p, "completion": c} for p, c in policy.items()]),
        sft=write_jsonl(root / "sft.jsonl", [{"prompt": p, "completion": c} for p, c in sft.items()]),
        references=references,
        policy_texts=policy,
        sft_texts=sft,
    )


def config_values(files: EvalFiles, base_url: str, out: Path, **overrides: Any) -> dict[str, Any]:
    """EvalConfig values for the eval set against an openai judge at `base_url` (fast retries)."""
    judge = {
        "backend": "openai",
        "model": "fake-judge",
        "base_url": base_url,
        "api_key_env": API_KEY_ENV,
        "max_attempts": 3,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 2.0,
        "timeout_s": 5.0,
        "max_concurrency": 8,
    }
    judge.update(overrides.pop("judge", {}))
    values = {
        "prompts": str(files.prompts),
        "reference_column": "reference",
        "policy_completions": str(files.policy),
        "sft_completions": str(files.sft),
        "judge": judge,
        "output_dir": str(out),
        "progress": False,
        "bootstrap_resamples": 1000,
    }
    values.update(overrides)
    return values


# ---------------------------------------------------------------- python-judge rules ("eval_helpers:<name>")
def recreate_first_batch(server, token: str):
    """Creates the fake server's first batch again, as a killed run had created it: the same rows through the
    Files + Batches endpoints, tagged with the run's submission token. Returns the created batch."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY)
    rows = list(server.batch_api.batches.values())[0].rows
    upload = client.files.create(file=("b.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode()),
                                 purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"rloo_token": token})


def marker_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    """An answer with "[win]" wins; two "[tie]" answers tie; otherwise the longer answer wins."""
    a_wins, b_wins = "[win]" in answer_a, "[win]" in answer_b
    if a_wins != b_wins:
        return "A" if a_wins else "B"
    if "[tie]" in answer_a and "[tie]" in answer_b:
        return "tie"
    return "A" if len(answer_a) >= len(answer_b) else "B"


def prefer_longer(prompt: str, answer_a: str, answer_b: str) -> str:
    if len(answer_a) == len(answer_b):
        return "tie"
    return "A" if len(answer_a) > len(answer_b) else "B"


def prefer_longer_batched(prompts: list[str], answers_a: list[str], answers_b: list[str]) -> list[str]:
    return [prefer_longer(p, a, b) for p, a, b in zip(prompts, answers_a, answers_b, strict=True)]


async def prefer_longer_async(prompt: str, answer_a: str, answer_b: str) -> str:
    await asyncio.sleep(0)
    return prefer_longer(prompt, answer_a, answer_b)


def verbose_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    return "Comparison: B is clearer.\nPreferred: B"


def unsure_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    return "maybe"


def broken_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    raise RuntimeError("bug in the rule")


# A handshake between the rule (in the judge's worker thread) and a coroutine on the event loop: the rule waits
# until the loop has answered, which it can only do if the rule is not blocking the loop.
RULE_STARTED, LOOP_ANSWERED = threading.Event(), threading.Event()


def handshake_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    RULE_STARTED.set()
    return "A" if LOOP_ANSWERED.wait(timeout=60) else "B"


def slow_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    time.sleep(0.05)
    return "A"


CALLS: list[tuple[str, str]] = []


def recording_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    """prefer_longer, recording each call in CALLS."""
    CALLS.append((answer_a, answer_b))
    return prefer_longer(prompt, answer_a, answer_b)


def _unit(*parts: str) -> float:
    """A uniform number in [0, 1) fixed by `parts` (a deterministic stand-in for a judge's randomness)."""
    import hashlib

    return int.from_bytes(hashlib.sha256("\x00".join(parts).encode()).digest()[:8], "big") / 2**64


def slot_biased_rule(prompt: str, answer_a: str, answer_b: str) -> str:
    """Half of the time "A" whatever the content; otherwise the answer marked "[better]" wins."""
    if _unit("slot", prompt, answer_a, answer_b) < 0.5:
        return "A"
    return "A" if "[better]" in answer_a else "B"


def marker_rule_no_length(prompt: str, answer_a: str, answer_b: str) -> str:
    """An answer with "[win]" wins; otherwise the one without it (the reference) wins: length plays no part."""
    if "[win]" in answer_a:
        return "A"
    if "[win]" in answer_b:
        return "B"
    return "B" if "ref" not in answer_a else "A"
