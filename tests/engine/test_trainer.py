"""The trainer end to end on tiny models: it learns, it resumes exactly, and each feature does what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rloo_engine import models
from rloo_engine.logprobs import batched_token_logps
from rloo_engine.run.fault_injection import CRASH_ENV
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import prompt_file, read_metrics, tiny_config


def mean_of(rows, key, sl):
    vals = [r[key] for r in rows[sl]]
    return sum(vals) / len(vals)


def test_policy_learns_the_reward(tmp_path, qwen2_model):
    """Trains on target-token fraction plus a large per-prompt constant that only a correct leave-one-out
    baseline cancels. Breaking it locally: advantage sign flipped -> 0.08 to 0.01; no baseline -> 0.08 to
    0.10; groups mixing prompts -> 0.08 to 0.10; correct -> 0.09 to 0.73.
    """
    cfg = tiny_config(
        tmp_path, qwen2_model, max_steps=40, learning_rate=1e-2, per_device_train_batch_size=16, max_completion_length=8,
        reward_funcs=["tests.engine.helpers:target_fraction_plus_prompt_offset", "tests.engine.helpers:target_token_fraction"],
        reward_weights=[1.0, 0.0],  # the second only reports the clean signal
    )
    RLOOTrainer(cfg).train()
    rows = read_metrics(cfg.output_dir)
    key = "rewards/target_token_fraction/mean"
    first, last = mean_of(rows, key, slice(0, 5)), mean_of(rows, key, slice(-5, None))
    assert last > first + 0.3, f"reward did not improve: first 5 steps {first:.3f}, last 5 steps {last:.3f}"


def test_a_large_beta_keeps_the_policy_closer_to_the_reference(tmp_path, qwen2_model):
    """The KL penalty through the trainer: same seed and data, beta 1.0 against beta 1e-4 (effectively none; 0
    would load no reference and log no KL). Measured: mean KL of the last 5 steps 0.033 vs 0.119. With the
    penalty's sign flipped in trainer/algorithm (+beta*kl) it read 0.240 vs 0.156; with the term dropped, equal."""
    kl = {}
    for beta in (1e-4, 1.0):
        cfg = tiny_config(tmp_path / str(beta), qwen2_model, max_steps=20, learning_rate=1e-2, beta=beta,
                          per_device_train_batch_size=16, max_completion_length=8)
        RLOOTrainer(cfg).train()
        kl[beta] = mean_of(read_metrics(cfg.output_dir), "kl", slice(-5, None))
    assert kl[1.0] < 0.5 * kl[1e-4], kl


def test_resume_matches_uninterrupted_run(tmp_path, qwen2_model, monkeypatch):
    common = dict(max_steps=6, save_steps=3, beta=0.05, num_iterations=2, steps_per_generation=2,
                  gradient_accumulation_steps=1, per_device_train_batch_size=4)
    straight = tiny_config(tmp_path / "a", qwen2_model, **common)
    RLOOTrainer(straight).train()

    resumed_dir = tmp_path / "b"
    monkeypatch.setenv(CRASH_ENV, "3")  # dies right after the step-3 checkpoint
    with pytest.raises(SystemExit) as exit_info:
        RLOOTrainer(tiny_config(resumed_dir, qwen2_model, **common)).train()
    assert exit_info.value.code == 3
    monkeypatch.delenv(CRASH_ENV)
    second_half = tiny_config(resumed_dir, qwen2_model, **common, resume_from_checkpoint="latest")
    result = RLOOTrainer(second_half).train()
    assert result.global_step == 6

    a = AutoModelForCausalLM.from_pretrained(Path(straight.output_dir) / "final")
    b = AutoModelForCausalLM.from_pretrained(Path(second_half.output_dir) / "final")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa, pb, msg=f"parameter {name} differs after resume")
    ma, mb = read_metrics(straight.output_dir), read_metrics(second_half.output_dir)
    assert [r["step"] for r in mb] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(ma, mb):
        assert set(ra) == set(rb)
        for key in set(ra) - {"step_time"} - {k for k in ra if k.startswith("timing/")}:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    assert sum("reward" in r for r in ma) == 2  # one generation batch per 2 x 2 micro-batches


def test_checkpoints_are_complete_pruned_and_loadable(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=7, save_steps=2, save_total_limit=2)
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    names = sorted(p.name for p in out.iterdir())
    assert "checkpoint-2" not in names and {"checkpoint-4", "checkpoint-6", "final", "config.yaml"} <= set(names)
    assert not [n for n in names if n.startswith(".tmp")]
    ckpt = out / "checkpoint-4"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and "sampler" in state
    assert (ckpt / "rank0.pt").is_file() and (ckpt / "accelerate").is_dir()
    AutoModelForCausalLM.from_pretrained(ckpt)
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_beta_zero_loads_no_reference_model(tmp_path, qwen2_model, monkeypatch):
    loads = []
    original = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, beta=0.0, max_steps=1))
    assert trainer.ref is None and len(loads) == 1
    trainer.train()
    assert "timing/reference_s" in read_metrics(trainer.cfg.output_dir)[0]
    with_ref = RLOOTrainer(tiny_config(tmp_path / "k", qwen2_model, beta=0.1, max_steps=1))
    assert with_ref.ref is not None and not any(p.requires_grad for p in with_ref.ref.parameters())


def test_on_policy_ratio_is_exactly_one_without_extra_forward(tmp_path, qwen2_model):
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, beta=0.0, max_steps=2))
    assert trainer.on_policy
    batch = trainer.generation_step()
    assert batch.old_token_logps is None  # no second policy forward was run
    trainer.train()
    for row in read_metrics(trainer.cfg.output_dir):
        assert row["clip_ratio/region_mean"] == 0.0


def test_off_policy_reuses_batch_with_stored_old_logps(tmp_path, qwen2_model):
    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, num_iterations=2, max_steps=2, learning_rate=5e-2))
    assert not trainer.on_policy
    batch = trainer.generation_step()
    forward = batched_token_logps(trainer.policy, batch.input_ids, batch.attention_mask, batch.prompt_length,
                                  trainer.cfg.temperature, 8)
    mask = batch.completion_mask
    assert batch.old_token_logps is not None and (batch.old_token_logps * mask - forward * mask).abs().max() < 1e-5
    trainer.train()
    # The second pass over each batch is off-policy: some ratio left 1 and was clipped or not, but measured.
    rows = read_metrics(trainer.cfg.output_dir)
    assert any(r["clip_ratio/region_mean"] > 0 or r["loss"] != 0 for r in rows)


def test_lora_trains_only_adapter_weights(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, lora_r=4, lora_alpha=8, beta=0.1,
                      lora_target_modules=["q_proj", "v_proj"], max_steps=3, learning_rate=1e-2)
    trainer = RLOOTrainer(cfg)
    assert trainer.ref is None  # the reference is the adapter-disabled base, not a copy
    before = {n: p.detach().clone() for n, p in trainer.policy.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.policy.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)
    assert (Path(cfg.output_dir) / "final" / "adapter_model.safetensors").is_file()  # the adapter, as TRL saves it


def test_reward_model_with_other_tokenizer_and_conversational_prompts(tmp_path, qwen2_model, reward_model_other_tokenizer):
    cfg = tiny_config(tmp_path, qwen2_model, reward_funcs=[], reward_model_name_or_path=str(reward_model_other_tokenizer),
                      dataset_name=str(prompt_file(tmp_path, conversational=True)), max_steps=2, beta=0.05)
    trainer = RLOOTrainer(cfg)
    trainer.train()
    row = read_metrics(cfg.output_dir)[-1]
    assert row["reward_std"] > 0  # the reward model scored real, varying text
    assert "rewards/reward_model/mean" in row
    assert trainer.last_samples[0]["prompt"].startswith("<|user|>")  # chat template applied


def test_async_and_none_reward_functions_with_weights(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=1, reward_weights=[2.0, 0.5],
                      reward_funcs=["tests.engine.helpers:async_length_reward", "tests.engine.helpers:sometimes_none_reward"])
    trainer = RLOOTrainer(cfg)
    trainer.train()
    row = read_metrics(cfg.output_dir)[0]
    assert row["rewards/sometimes_none_reward/mean"] == 1.0
    assert row["frac_unscorable"] == 0.0  # the async function scores every row


def test_unscorable_rows_get_zero_advantage_and_no_loss_weight(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, reward_funcs=["tests.engine.helpers:never_scores"], max_steps=1)
    batch = RLOOTrainer(cfg).generation_step()
    assert torch.all(batch.advantages == 0) and torch.all(batch.loss_weights == 0)


def test_mask_truncated_completions(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, mask_truncated_completions=True, max_completion_length=3)
    trainer = RLOOTrainer(cfg)
    batch = trainer.generation_step()
    last = batch.input_ids[:, -1]
    eos = torch.tensor(list(trainer.model_eos_ids))
    truncated = (batch.completion_mask.sum(-1) == 3) & ~torch.isin(last, eos)  # 3 tokens, none of them an EOS
    assert truncated.any()  # a random-init model rarely stops within 3 tokens: the rule is exercised
    assert torch.all(batch.loss_weights[truncated] == 0)
    assert torch.all(batch.loss_weights[~truncated] > 0)


def test_reference_sync_moves_reference_towards_policy(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, beta=0.1, sync_ref_model=True, ref_model_sync_steps=1,
                      ref_model_mixup_alpha=1.0, max_steps=2, learning_rate=1e-2)
    trainer = RLOOTrainer(cfg)
    trainer.train()
    for p_ref, p_pol in zip(trainer.ref.parameters(), trainer.acc.unwrap_model(trainer.policy).parameters()):
        torch.testing.assert_close(p_ref, p_pol)


def test_metrics_use_trl_names(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, beta=0.05, max_steps=1, log_completions=True)
    RLOOTrainer(cfg).train()
    row = read_metrics(cfg.output_dir)[0]
    expected = {
        "reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "loss", "grad_norm", "learning_rate",
        "num_tokens", "step_time", "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean",
        "clip_ratio/high_max", "clip_ratio/region_mean", "completions/mean_length", "completions/min_length",
        "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
        "rewards/target_token_fraction/mean", "rewards/target_token_fraction/std", "timing/generation_s",
        "timing/reward_s", "timing/reference_s", "timing/policy_update_s",
    }
    assert expected <= set(row), expected - set(row)
    samples = (Path(cfg.output_dir) / "completions.jsonl").read_text().splitlines()
    assert len(samples) == 8 and {"prompt", "completion", "reward", "advantage"} <= set(json.loads(samples[0]))


def test_llama_shaped_policy_trains(tmp_path, llama_model):
    result = RLOOTrainer(tiny_config(tmp_path, llama_model, max_steps=2, beta=0.05)).train()
    assert result.global_step == 2 and (result.final_dir / "config.json").is_file()
