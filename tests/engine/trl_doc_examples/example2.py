# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 2: Reward completions with a specific format; Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.
# ruff: noqa: I001  (the docs' spacing, kept)

import re

def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]
