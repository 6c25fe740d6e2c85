"""The offline demo: a synthetic task with a hidden gold rule, its SFT policy and reward model, and their cached build."""
