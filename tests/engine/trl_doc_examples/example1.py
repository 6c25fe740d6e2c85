# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 1: Reward longer completions; Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]
