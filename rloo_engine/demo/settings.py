"""Recommended settings of the offline demo: how its assets are built, and how RLOO trains and is evaluated on them.

`DEMO_*` is the full demo (assets in about 95 s, 250 RLOO steps in about 50 s, on 2 busy CPU cores);
`SMOKE_*` is the CI smoke run: the same code path, sized to finish in seconds. The numbers were
measured on 2 shared CPU cores; docs/demo.md has the results.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AssetSettings:
    """What `build_demo_assets` builds. Every field is part of the cache key, so a change rebuilds."""

    vocab_size: int = 512  # byte-level BPE trained on task text; every task word becomes one token
    # Policy width and depth: 128 x 2 layers is about 0.46M parameters. Wider models cost more CPU per
    # step and, in a fixed budget, give a worse reward model (256 wide: 3x the build time, 0.59 accuracy).
    hidden: int = 128
    layers: int = 2
    sft_examples: int = 20_000  # synthetic (prompt, completion) pairs; SFT sees each at most once or twice
    sft_steps: int = 600
    sft_batch_size: int = 32
    sft_learning_rate: float = 3e-3  # high for a fresh tiny model; warmup then cosine decay
    rm_steps: int = 300  # the reward model sees rm_steps * rm_batch_size fresh pairs, once each
    rm_batch_size: int = 32
    rm_learning_rate: float = 1e-3
    rm_edit_fraction: float = 0.7  # share of one-edit pairs (see task.edited_completion)
    rm_heldout_pairs: int = 500
    eval_fraction: float = 0.25  # share of prompt specs held out for evaluation (768 specs in all)
    eval_prompts: int = 192  # at most round(768 * eval_fraction) distinct prompts exist


DEMO_ASSETS = AssetSettings()

SMOKE_ASSETS = AssetSettings(
    vocab_size=400, hidden=32, layers=1, sft_examples=2_000, sft_steps=40, sft_batch_size=16,
    rm_steps=60, rm_batch_size=16, rm_heldout_pairs=200, eval_prompts=16,
)

# RLOOConfig options of the demo's RLOO run (names and meanings: docs/configuration.md). The caller
# adds model_name_or_path (assets.sft_dir), reward_model_name_or_path (assets.reward_model_dir),
# dataset_name (assets.train_prompts) and output_dir.
DEMO_TRAIN: dict = {
    "num_generations": 8,  # G: a group of 8 gives a low-variance leave-one-out baseline
    "per_device_train_batch_size": 32,  # completions per step: 4 prompts x 8
    "max_completion_length": 24,  # two sentences fit; a third is cut off and loses the gold finish bonus
    "max_prompt_length": 32,
    "temperature": 1.0,
    "learning_rate": 2e-4,  # a tiny model moves at rates far above the 1e-6 usual for large LMs
    "lr_scheduler_type": "constant",
    "beta": 0.05,  # KL coefficient: small enough to let the reward climb, large enough to slow reward hacking
    "max_steps": 250,
    "logging_steps": 10,
    "save_steps": 0,
    "log_completions": True,
    "num_completions_to_print": 2,
    "seed": 0,
    # The gold rule rides along with weight 0: it never shapes the reward, but `rewards/gold_reward/mean`
    # is logged at every step, so the run shows whether the reward model's gains are real.
    "reward_funcs": ["rloo_engine.demo.toy_task:gold_reward"],
    "reward_weights": [1.0, 0.0],
}

SMOKE_TRAIN: dict = {
    **DEMO_TRAIN,
    "num_generations": 4,
    "per_device_train_batch_size": 8,
    "max_completion_length": 12,
    "max_steps": 4,
    "logging_steps": 2,
    "log_completions": False,
}

# Evaluation generation options (rloo_engine.evaluation EvalGenerationConfig names). Sampling at the training
# temperature measures the distribution RLOO optimised; greedy decoding of a model this small tends to
# loop on one phrase, which says little about either model.
DEMO_EVAL_GENERATION: dict = {"max_new_tokens": 24, "do_sample": True, "temperature": 1.0, "batch_size": 64, "seed": 0}
SMOKE_EVAL_GENERATION: dict = {**DEMO_EVAL_GENERATION, "max_new_tokens": 12}

# Environment of the RLOO training process (PipelineConfig `launch.env`). `accelerate launch` on CPU
# otherwise starts one intra-op thread per physical core; for models this small a second thread gains
# little and, when the Prefect and MLflow processes share the cores, costs several times the run time.
DEMO_LAUNCH_ENV: dict = {"OMP_NUM_THREADS": "1"}
