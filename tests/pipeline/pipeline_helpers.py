"""Helpers shared by the pipeline tests: the repository root and a tiny, fast pipeline configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parents[2]


def tiny_pipeline_config(assets: dict[str, Path], output_root: Path) -> dict[str, Any]:
    """A pipeline config that runs in well under a minute on 2 CPU cores; the gate threshold always passes."""
    return {
        "sft": {"source": str(assets["sft"])},
        "reward": {
            "model": str(assets["reward_model"]),
            "functions": ["rloo_engine.reward_functions:char_fraction"],
            "weights": [0.1, 1.0],
        },
        "data": {
            "train_prompts": str(assets["train_prompts"]),
            "eval_prompts": str(assets["eval_prompts"]),
            "reference_column": "reference",
        },
        "train": {
            "num_generations": 4,
            "per_device_train_batch_size": 16,
            "max_completion_length": 12,
            "max_prompt_length": 32,
            "learning_rate": 3.0e-3,
            "beta": 0.01,
            "max_steps": 8,
            "logging_steps": 2,
            "save_steps": 4,
            "log_completions": True,
            "num_completions_to_print": 1,
            "seed": 0,
            "disable_tqdm": True,
        },
        "launch": {
            "profile": "cpu",
            "log_interval_seconds": 2,
            "retries": 1,
            "retry_delay_seconds": 0,
            "kill_grace_seconds": 5,
        },
        "evaluation": {
            "judge": {"backend": "python", "function": "tests.pipeline.judge_rules:prefer_more_e"},
            "num_samples": 16,
            "generation": {"max_new_tokens": 12, "batch_size": 16},
            "bootstrap_resamples": 1000,
        },
        "tracking": {
            "experiment": "pipeline-tests",
            "registered_model": "tiny-policy",
            "promotion": {"min_ci_low": 0.0, "min_n": 1, "alias": "candidate"},
        },
        "output_root": str(output_root),
    }


def training_processes(flow_run_id: str) -> list[psutil.Process]:
    """The accelerate launcher and engine processes of this flow run (their command lines hold its output dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if flow_run_id in cmdline and "rloo_config.yaml" in cmdline:
            found.append(proc)
    return found
