"""What the train stage reads back from the engine's output directory: metrics rows, their summary, the reward curve."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file the engine writes (metrics.jsonl, completions.jsonl); [] when it does not exist."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Reward at the first and last logging steps (and the mean of the first/last quarter), final KL."""
    if not rows:
        return {}
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, len(rewards) // 4)
    summary = {"global_step": float(rows[-1]["step"]), "logged_steps": float(len(rows))}
    if rewards:
        summary.update(
            reward_start=rewards[0],
            reward_end=rewards[-1],
            reward_first_quarter=sum(rewards[:k]) / k,
            reward_last_quarter=sum(rewards[-k:]) / k,
        )
    for key in ("kl", "completions/mean_length", "loss"):
        values = [r[key] for r in rows if key in r]
        if values:
            summary[f"{key.replace('completions/', '')}_end"] = values[-1]
    return summary


def plot_reward_curve(rows: list[dict[str, float]], path: Path) -> Path | None:
    """reward (with ±reward_std) and KL against step, as a PNG (matplotlib, Agg backend, no display needed)."""
    points = [r for r in rows if "reward" in r]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in points]
    reward = [r["reward"] for r in points]
    std = [r.get("reward_std", 0.0) for r in points]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, reward, marker="o", label="reward")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(reward, std, strict=True)],
        [m + s for m, s in zip(reward, std, strict=True)],
        alpha=0.2,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if any("kl" in r for r in points):
        kl_ax = ax.twinx()
        kl_ax.plot(steps, [r.get("kl", float("nan")) for r in points], color="tab:red", linestyle="--", label="kl")
        kl_ax.set_ylabel("kl", color="tab:red")
    ax.set_title("RLOO reward curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
