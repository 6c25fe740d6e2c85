"""What differs between the transformers releases pyproject.toml allows (5.17 .. current), chosen at run time.
CI runs the engine tests on the oldest (scripts/test_engine_on_transformers.sh) and on the venv's."""

import inspect
import os
import subprocess
import sys

import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from rloo_engine.generation.kv_cache import cache_keyword
from tests.engine.helpers import repo_pythonpath


def test_the_cache_keyword_is_the_one_the_models_forward_takes(qwen2_model):
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    keyword = cache_keyword(model)
    assert keyword in inspect.signature(model.forward).parameters
    # 5.24 renamed past_key_values to cache; older releases reject `cache` in generate.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert keyword == ("cache" if (major, minor) >= (5, 24) else "past_key_values")


def test_a_peft_wrapper_gets_the_base_models_keyword(qwen2_model):
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    keyword = cache_keyword(model)
    wrapped = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    assert "kwargs" in inspect.signature(wrapped.forward).parameters  # the wrapper's own signature says nothing
    assert cache_keyword(wrapped) == keyword


def test_child_processes_run_the_same_transformers_as_the_tests():
    # The process tests (CLI, accelerate launch, DeepSpeed) would otherwise test the venv's release only.
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    proc = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == transformers.__version__, proc.stderr
