"""The reward check before training: each reward source scores a few training prompts (each with another prompt's
text as a stand-in completion). NaN or constant reward-model scores reject the model: a broken head or a pooling
bug would otherwise train the policy on noise."""

from __future__ import annotations

import logging
import math

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import DataSection, RewardSection
from rloo_engine.pipeline.stage_results import RewardStats

log = logging.getLogger(__name__)


def _short(value: float | None) -> str:
    """A probe statistic as the log shows it: 4 significant digits (a 16-prompt mean is not known to 17)."""
    return "n/a" if value is None else f"{value:.4g}"


def probe_rewards(
    reward: RewardSection,
    data: DataSection,
    tokenizer_path: str,
    model_path: str | None,
    dtype: str = "float32",
    logger: logging.Logger | logging.LoggerAdapter = log,
) -> tuple[dict[str, RewardStats], dict[str, list]]:
    """Scores `reward.probe_samples` training prompts, each with another prompt's text as a stand-in completion."""
    import torch
    from transformers import AutoTokenizer

    from rloo_engine.data import extra_columns, load_prompt_dataset
    from rloo_engine.models import DTYPES
    from rloo_engine.reward_context import standalone_reward_kwargs
    from rloo_engine.reward_sources import RewardModelSource, compute_rewards, load_reward_function

    dataset = load_prompt_dataset(data.train_prompts, data.train_config, data.train_split)
    rows = [dataset[i] for i in range(min(reward.probe_samples, len(dataset)))]
    prompts = [r["prompt"] for r in rows]
    # Real text from the same distribution, different for every row, so a working model cannot score it all alike.
    texts = [_plain_text(p) for p in prompts]
    completions = [" " + texts[(i + 1) % len(texts)] for i in range(len(texts))]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    completion_ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]

    sources = []
    if model_path:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # the table training loads with: `auto` is the checkpoint's dtype there and here (it was float32 here)
        sources.append(RewardModelSource(model_path, device=device, dtype=DTYPES[dtype]))
    sources.extend(load_reward_function(f) for f in reward.functions)
    # The keyword arguments training passes too (`trainer_state` at step 0; what is logged goes nowhere).
    result = compute_rewards(sources, reward.weights, None, prompts, completions, completion_ids, extra_columns(rows),
                             standalone_reward_kwargs())

    stats: dict[str, RewardStats] = {}
    table: dict[str, list] = {"prompt": [str(p) for p in prompts], "completion": completions}
    for j, name in enumerate(result.names):
        column = result.per_source[:, j]
        table[name] = [None if math.isnan(v) else v for v in column.tolist()]
        scored = column[~column.isnan()]
        s = RewardStats(
            mean=scored.mean().item() if scored.numel() else None,
            std=scored.std().item() if scored.numel() > 1 else None,
            min=scored.min().item() if scored.numel() else None,
            max=scored.max().item() if scored.numel() else None,
            n_scored=scored.numel(),
        )
        stats[name] = s
        logger.info("reward probe %s: mean=%s std=%s over %d of %d", name, _short(s.mean), _short(s.std), s.n_scored,
                    len(prompts))
        if name == "reward_model":
            _check_model_scores(column, model_path or "", len(set(completions)))
        elif s.n_scored == 0:
            logger.warning("reward.functions: %s returned None for every probe completion", name)
    del sources
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the GPU belongs to the training process next
    return stats, table


def _check_model_scores(scores, path: str, distinct_inputs: int) -> None:
    if scores.isnan().any():
        raise ConfigError(f"reward.model: {path} returned NaN for {int(scores.isnan().sum())} probe completions")
    if distinct_inputs > 1 and (scores.max() - scores.min()).item() <= 1e-6 * max(1.0, scores.abs().max().item()):
        raise ConfigError(
            f"reward.model: {path} gave every probe completion the same score ({scores[0].item():.6g}); "
            "a constant reward carries no signal (untrained head? wrong pooling or pad token?)"
        )


def _plain_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return str(prompt[-1].get("content", "")) if prompt else ""
