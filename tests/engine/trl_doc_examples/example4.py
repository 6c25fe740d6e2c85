# Copied unchanged from TRL's documentation (huggingface/trl, docs/source/rloo_trainer.md, "Using a custom reward
# function", Example 4: Multi-task reward functions; Apache-2.0):
# the code below is TRL's, byte for byte; tests/engine/test_reward_function_kwargs.py trains the engine with it.
# The example's `RLOOTrainer(...)` call is left out: the test trains the engine on `dataset` instead. The two checks
# the example leaves to the reader are defined first, above the example's own code.
from datasets import Dataset


def check_math_solution(prompt, completion):
    """The answer to "What is a+b?" / "What is a*b?": the completion's text is the result."""
    expression = prompt.removeprefix("What is ").removesuffix("?")
    a, op, b = expression[0], expression[1], expression[2:]
    return completion.strip() == str(int(a) + int(b) if op == "+" else int(a) * int(b))


def test_code_solution(prompt, completion):
    """Never reached with this dataset: its coding rows say `task: "code"`, the example's function checks
    `"coding"` (as TRL's docs have it), so `coding_reward_func` returns None for every row."""
    return "def " in completion


# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": "What is 2+2?", "task": "math"},
        {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
        {"prompt": "What is 3*4?", "task": "math"},
        {"prompt": "Write a function that returns the product of two numbers.", "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "coding":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards
