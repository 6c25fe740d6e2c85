# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 1.1: Reward longer completions (based on the number of characters); Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.


def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""
    return [float(len(completion)) for completion in completions]
