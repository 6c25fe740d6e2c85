# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 3: Reward completions based on a reference; Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.
# ruff: noqa: I001  (the docs' spacing, kept)

import re

def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
