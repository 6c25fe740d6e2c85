"""The vLLM colocate backend against a fake `vllm` module (vLLM needs a GPU and cannot run here).

The fake records what the backend asks of vLLM and returns scripted completions, so these tests check
our side of the boundary: token-id prompts, sampling parameters, rollout layout, weight sync.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine.config_base import ConfigError
from rloo_engine.generation import SamplingParams


class FakeLLM:
    instances: list[FakeLLM] = []

    def __init__(self, **kwargs):
        self.kwargs, self.requests, self.loaded, self.cache_resets = kwargs, [], [], 0
        FakeLLM.instances.append(self)

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.requests.append((prompts, sampling_params))
        eos = 1
        scripted = [[5, 6, eos], [7, 8, 9, 10], [eos], [11]]  # ends, truncated, immediate EOS, short-unfinished
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=scripted[(i * sampling_params.n + j) % 4])
                                               for j in range(sampling_params.n)]) for i, _ in enumerate(prompts)]

    def apply_model(self, fn):
        fn(types.SimpleNamespace(load_weights=lambda items: self.loaded.append({k: v.clone() for k, v in items})))  # vLLM copies

    def reset_prefix_cache(self):
        self.cache_resets += 1


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return module


def test_rollout_layout_and_sampling_params(fake_vllm, qwen2_model):
    from rloo_engine.generation_vllm import VLLMColocateBackend

    tok = AutoTokenizer.from_pretrained(qwen2_model)
    params = SamplingParams(max_completion_length=4, temperature=0.7, top_k=None, max_prompt_length=8)
    backend = VLLMColocateBackend(str(qwen2_model), tok, params, gpu_memory_utilization=0.25, seed=3)
    llm = FakeLLM.instances[0]
    assert llm.kwargs["gpu_memory_utilization"] == 0.25 and llm.kwargs["max_model_len"] == 12

    rollout = backend.generate(["the cat sat", "a big red fox jumps"], 2)
    prompts, sp = llm.requests[0]
    assert prompts[0] == {"prompt_token_ids": tok("the cat sat", add_special_tokens=False)["input_ids"]}
    assert sp.n == 2 and sp.temperature == 0.7 and sp.top_k == -1 and sp.max_tokens == 4
    assert rollout.completion_ids.shape == (4, 4) and rollout.prompt_ids.shape[0] == 4
    # rows 0,1 share prompt 0 (left-padded), rows 2,3 share prompt 1
    assert torch.equal(rollout.prompt_ids[0], rollout.prompt_ids[1]) and rollout.prompt_mask[0, 0] == 0
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert rollout.terminated.tolist() == [True, False, True, False]  # pad == eos never fakes an ending
    assert rollout.completion_ids[0, 3].item() == tok.pad_token_id


def test_sync_weights_loads_policy_and_resets_cache(fake_vllm, qwen2_model):
    from rloo_engine.generation_vllm import VLLMColocateBackend

    tok = AutoTokenizer.from_pretrained(qwen2_model)
    backend = VLLMColocateBackend(str(qwen2_model), tok, SamplingParams(max_completion_length=4))
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    backend.sync_weights(model)
    llm = FakeLLM.instances[0]
    assert llm.cache_resets == 1
    assert set(llm.loaded[0]) == set(model.state_dict())


def test_missing_vllm_is_a_clear_config_error(monkeypatch, qwen2_model):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    from rloo_engine.generation_vllm import VLLMColocateBackend

    with pytest.raises(ConfigError, match=r"use_vllm: true, but vllm is not installed"):
        VLLMColocateBackend(str(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model), SamplingParams(4))


def test_server_mode_is_rejected_at_load_time():
    from rloo_engine.cli import parse_train_args

    with pytest.raises(ConfigError, match="vllm_mode: 'server' is not implemented"):
        parse_train_args(["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "a:b",
                          "--use_vllm", "--vllm_mode", "server"])


def test_lora_sync_sends_merged_base_weights_under_base_names(fake_vllm, qwen2_model):
    from peft import LoraConfig, get_peft_model

    from rloo_engine.generation_vllm import VLLMColocateBackend

    tok = AutoTokenizer.from_pretrained(qwen2_model)
    backend = VLLMColocateBackend(str(qwen2_model), tok, SamplingParams(max_completion_length=4))
    base = AutoModelForCausalLM.from_pretrained(qwen2_model)
    names = set(base.state_dict())
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    before = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    backend.sync_weights(model)
    sent = FakeLLM.instances[0].loaded[0]
    assert set(sent) == names  # no lora_ or base_layer names reach vLLM
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sent[q], before[q.replace("q_proj.", "q_proj.base_layer.")])  # adapter merged in
    after = {k: v for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    for k in before:  # and unmerged again afterwards (up to float rounding of W + BA - BA)
        torch.testing.assert_close(before[k], after[k])


def test_completions_ending_at_a_generation_config_eos_id_count_as_terminated(fake_vllm, qwen2_model):
    """vLLM stops at every id in `stop_token_ids`; the rollout must then call those completions terminated."""
    from rloo_engine.generation_vllm import VLLMColocateBackend

    tok = AutoTokenizer.from_pretrained(qwen2_model)
    other_eos = 7  # e.g. Qwen2.5's <|endoftext|> beside the tokenizer's <|im_end|>
    params = SamplingParams(max_completion_length=4, eos_token_ids=(tok.eos_token_id, other_eos))
    backend = VLLMColocateBackend(str(qwen2_model), tok, params)
    rollout = backend.generate(["the cat sat", "a big red fox jumps"], 2)  # scripted row 1 is [7, 8, 9, 10]
    assert FakeLLM.instances[0].requests[0][1].stop_token_ids == [tok.eos_token_id, other_eos]
    assert rollout.terminated.tolist() == [True, True, True, False]
    assert rollout.completion_mask[1].tolist() == [1, 0, 0, 0]  # nothing after the EOS is trained on
