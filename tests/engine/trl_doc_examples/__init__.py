"""TRL's documented reward-function examples, one module each (several share the name `reward_func`), copied as the
RLOO trainer docs show them; tests/engine/test_reward_function_kwargs.py trains with each."""
