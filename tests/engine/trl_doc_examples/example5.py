# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 5: Asynchronous reward functions; Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.
# ruff: noqa: I001  (the docs' spacing, kept)

import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
