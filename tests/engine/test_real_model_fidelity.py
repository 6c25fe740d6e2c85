"""Behaving like TRL on real-shaped chat models: EOS lists, BOS, bf16 autocast, LoRA dropout and reference, metric semantics."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rloo_engine.config_base import ConfigError
from rloo_engine.testing.tiny_chat_models import build_chat_model
from rloo_engine.testing.tiny_models import build_reward_model
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import prompt_file, read_metrics, tiny_config


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one AcceleratorState per process; these tests switch bf16 on and off between trainers."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module", params=["qwen", "llama3"])
def chat_model(request, tmp_path_factory):
    return request.param, build_chat_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama3_with_rm(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3_rm")
    policy = build_chat_model(root / "policy", "llama3")
    from transformers import AutoTokenizer

    rm = build_reward_model(root / "rm", AutoTokenizer.from_pretrained(policy), arch="llama", seed=4)
    return policy, rm


class PreferToken(LogitsProcessor):
    """Adds a large bias to one token id: the policy says it first. (`sequence_bias` does the same, but
    transformers 5.17-5.23 reject token id 0 there, and a chat model's EOS may be id 0.)"""

    def __init__(self, token_id: int):
        self.token_id = token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token_id] += 100.0
        return scores


def test_completions_stop_at_every_eos_id_of_the_generation_config(tmp_path, chat_model):
    style, path = chat_model
    trainer = RLOOTrainer(tiny_config(tmp_path, path, mask_truncated_completions=True, max_completion_length=5))
    eos_ids = trainer.model_eos_ids
    assert len(eos_ids) == (2 if style == "qwen" else 3)
    for eos in eos_ids:
        trainer.backend.params.extra = {"logits_processor": LogitsProcessorList([PreferToken(eos)])}
        batch = trainer.generation_step()
        assert batch.input_ids[:, batch.prompt_length].eq(eos).all(), eos
        assert batch.completion_mask.sum(-1).eq(1).all(), f"{style}: generation ran past EOS id {eos}"
        assert batch.loss_weights.eq(1).all(), f"{style}: EOS id {eos} was counted as truncated"


@pytest.mark.parametrize("conversational", [False, True])
def test_policy_and_reward_model_see_exactly_one_bos(tmp_path, llama3_with_rm, conversational):
    policy, rm = llama3_with_rm
    cfg = tiny_config(tmp_path, policy, reward_model_name_or_path=str(rm), reward_funcs=[], max_prompt_length=64,
                      dataset_name=str(prompt_file(tmp_path, conversational=conversational)))
    trainer = RLOOTrainer(cfg)
    bos, header = trainer.tokenizer.bos_token_id, trainer.tokenizer.convert_tokens_to_ids("<|start_header_id|>")
    seen = []
    source = trainer.reward_sources[0]
    handle = source.model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"], kw["attention_mask"])),
                                                    with_kwargs=True)
    batch = trainer.generation_step()
    handle.remove()
    real = batch.input_ids[:, : batch.prompt_length][batch.attention_mask[:, : batch.prompt_length].bool()]
    assert (real == bos).sum().item() == batch.input_ids.size(0)  # one BOS per policy prompt
    for ids, mask in seen:
        for row, m in zip(ids, mask):
            tokens = row[m.bool()]
            assert (tokens == bos).sum().item() == 1
            # the chat template applied once: a user header and an assistant header
            assert (tokens == header).sum().item() == (2 if conversational else 0)


@pytest.mark.parametrize("use_peft", [False, True])
def test_step_one_kl_is_exactly_zero_in_bf16(tmp_path, qwen2_model, use_peft, capsys):
    lora = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"]) if use_peft else {}
    RLOOTrainer(tiny_config(tmp_path, qwen2_model, bf16=True, beta=0.1, max_steps=1, **lora)).train()
    assert read_metrics(tmp_path / "out")[0]["kl"] == 0.0
    # fused_decode is refused for what it is, not by a failed probe: accelerate runs the forward under autocast,
    # which the check outside the forward did not see (it printed "its check failed (RuntimeError: ...dtype")
    said = capsys.readouterr().err
    assert "its check failed" not in said
    if not use_peft:
        assert "fused_decode: mixed precision (accelerate runs the model's forward under autocast)" in said


def test_conversational_bf16_lora_run_on_a_chat_model(tmp_path, chat_model):
    """The whole path on each real-shaped model; the reward function is written the TRL way for chat data.

    Dropout is left on in the model (attention_dropout 0.3, disable_dropout false): the reference
    log-probs must still come from eval mode, so KL is 0 while the adapters are still zero.
    """
    style, _ = chat_model
    path = build_chat_model(tmp_path / "dropout_model", style, attention_dropout=0.3)
    cfg = tiny_config(tmp_path, path, dataset_name=str(prompt_file(tmp_path, conversational=True)),
                      reward_funcs=["tests.engine.helpers:trl_style_reply_length"], bf16=True, beta=0.1,
                      use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.05,
                      lora_target_modules=["q_proj", "v_proj"], disable_dropout=False, max_steps=2)
    RLOOTrainer(cfg).train()
    rows = read_metrics(tmp_path / "out")
    assert rows[0]["kl"] == 0.0
    assert all(r["rewards/trl_style_reply_length/mean"] > 0 for r in rows)  # every reply was read and scored
    assert rows[0]["reward_std"] > 0  # from the reply text, not a constant


def test_dropout_is_off_after_lora_wrapping(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.05,
                      lora_target_modules=["q_proj", "v_proj"])
    policy = RLOOTrainer(cfg).policy
    rates = {type(m).__name__: m.p for m in policy.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates and set(rates.values()) == {0.0}, rates  # the lora_dropout modules included


def test_kl_is_per_token_as_in_trl_and_the_sequence_kl_has_its_own_name(tmp_path, qwen2_model):
    RLOOTrainer(tiny_config(tmp_path, qwen2_model, beta=0.1, learning_rate=3e-2, max_steps=3)).train()
    last = read_metrics(tmp_path / "out")[-1]
    assert last["sequence_kl"] != 0.0
    # one generation batch per step, one process: per-token KL = total KL / total completion tokens
    assert last["kl"] == pytest.approx(last["sequence_kl"] / last["completions/mean_length"], rel=1e-5)


@pytest.mark.parametrize("flags, why", [(dict(use_peft=True, beta=0.1), "use_peft: true"),
                                        (dict(beta=0.0), "beta: 0")])
def test_sync_ref_model_without_a_separate_reference_is_rejected(tmp_path, qwen2_model, flags, why):
    with pytest.raises(ConfigError, match=f"sync_ref_model: true has nothing to sync with {why}"):
        tiny_config(tmp_path, qwen2_model, sync_ref_model=True, **flags)


PROCESSORS = {"suppress_tokens": [5, 6], "min_new_tokens": 3, "no_repeat_ngram_size": 2}
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def qwen_chat(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("qwen_kl"), "qwen")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("processors", [False, True], ids=["no-processors", "processors"])
@pytest.mark.parametrize("chunked", [False, True], ids=["full-logits", "chunked"])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_step_1_kl_is_exactly_0_between_identical_models(tmp_path, qwen_chat, bf16, chunked, processors, lora):
    """Generate-time processors (issue 22 defect 1) and the chunked head under mixed precision (defect 2) each
    made the policy and the reference disagree before a single update. Decoding log-probs in fp32 without
    processors are a different computation (KV-cached) and agree to ~1e-7 per sequence; with `forward` it is 0."""
    sampling = ["auto", "forward"] if not (bf16 or processors) else ["auto"]
    for mode in sampling:
        cfg = tiny_config(tmp_path / mode, qwen_chat, bf16=bf16, chunked_logprobs=chunked, beta=0.1, max_steps=1,
                          sampling_logprobs=mode, generation_kwargs=PROCESSORS if processors else {},
                          dataset_name=str(prompt_file(tmp_path / mode, conversational=True)), **(LORA if lora else {}))
        RLOOTrainer(cfg).train()
        row = read_metrics(tmp_path / mode / "out")[0]
        if mode == "auto" and not (bf16 or processors):  # the decoding log-probs
            assert abs(row["sequence_kl"]) < 1e-6 and row["sequence_kl"] != 0.0, row["sequence_kl"]
        else:
            assert row["kl"] == 0.0 and row["sequence_kl"] == 0.0, (mode, row["kl"], row["sequence_kl"])


def test_decoding_logprobs_with_processors_are_refused_when_asked_for(tmp_path, qwen_chat):
    cfg = tiny_config(tmp_path, qwen_chat, beta=0.1, sampling_logprobs="generation",
                      generation_kwargs={"min_new_tokens": 3})
    with pytest.raises(ConfigError, match=r"sampling_logprobs: 'generation' with logits processors min_new_tokens"):
        RLOOTrainer(cfg)


def test_the_models_own_generation_config_processors_are_seen(qwen_chat):
    from transformers import GenerationConfig

    from rloo_engine.generation.hf import logit_processors_in_use

    gen = GenerationConfig.from_pretrained(qwen_chat)
    assert logit_processors_in_use(gen, {}) == []
    gen.suppress_tokens = [7]
    assert logit_processors_in_use(gen, {"stop_strings": ["x"]}) == ["suppress_tokens (the model's generation_config)"]
    assert logit_processors_in_use(gen, {"suppress_tokens": [8]}) == ["suppress_tokens"]
