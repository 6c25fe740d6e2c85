"""DeepSpeed ZeRO-2/3 for real: 2 CPU processes (gloo, `DS_ACCELERATOR=cpu`), the shipped profiles as they are.

One 4-step DDP run of the same config and seed is the reference the ZeRO runs are compared with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.engine.helpers import prompt_file, read_metrics
from tests.engine.test_cli_and_processes import REPO, run

pytestmark = pytest.mark.slow

PROFILES = REPO / "deployments" / "accelerate"
LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]


def train_args(model: Path, rm: Path, data: Path, out: Path, *extra: str) -> list[str]:
    # Constant LR: a 3-step run resumed to step 4 then follows the same schedule as a straight 4-step run.
    return ["--model_name_or_path", str(model), "--reward_model_name_or_path", str(rm), "--dataset_name", str(data),
            "--output_dir", str(out), "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--max_completion_length", "6", "--beta", "0.05", "--learning_rate", "1e-3",
            "--lr_scheduler_type", "constant", "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
            "--disable_tqdm", *extra]


def launch(profile: str | Path | None, target: list[str], crash_at: int | None = None, env: dict | None = None,
           processes: int = 2):
    """`profile`: a shipped profile's name, an accelerate YAML's path, or None for plain DDP; `env`: more variables."""
    config = profile if isinstance(profile, Path) else PROFILES / f"{profile}.yaml"
    launcher = ["--config_file", str(config)] if profile else [
        "--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    env = {"DS_ACCELERATOR": "cpu", **({"RLOO_ENGINE_CRASH_AT_STEP": str(crash_at)} if crash_at else {}), **(env or {})}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return run([sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", str(processes),
                    "--main_process_port", "0", *target])  # 29500 may be taken by another launch
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def engine(*args: str) -> list[str]:
    return ["-m", "rloo_engine", "train", *args]


def digest_script(*args: str) -> list[str]:
    return [str(REPO / "tests/engine/scripts/train_and_digest.py"), *args]


def final_weights(out: Path, name: str = "final") -> dict[str, torch.Tensor]:
    return load_file(out / name / "model.safetensors")


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ZeRO shards gradients and reduces them in another order (reduce-scatter of flattened buckets instead of
# DDP's all-reduce), so float32 sums differ in the last bits; Adam turns that into updates that differ by
# about 1e-7 here. 1e-5 is 1/400 of the 4e-3 the weights move in these 4 steps: a wrong gradient
# average, a skipped step or a lost clip would be far above it.
ZERO_VS_DDP_ATOL = 1e-5


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, qwen2_model, reward_model) -> Path:
    tmp = tmp_path_factory.mktemp("ddp")
    out = tmp / "out"
    proc = launch(None, digest_script(*train_args(qwen2_model, reward_model, prompt_file(tmp), out)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def crash_then_resume(profile: str, tmp: Path, model: Path, rm: Path, *extra: str) -> Path:
    """The engine command under `profile`: killed after step 3 (checkpoint-2 on disk), then resumed to step 4."""
    out = tmp / "out"
    args = train_args(model, rm, prompt_file(tmp), out, *extra)
    first = launch(profile, engine(*args), crash_at=3)
    assert "RLOO_ENGINE_CRASH_AT_STEP=3 reached" in first.stderr, first.stderr[-4000:]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    shards = sorted(p.name for p in (out / "checkpoint-2").rglob("*zero_pp_rank*"))
    assert any("rank_0" in s for s in shards) and any("rank_1" in s for s in shards), shards
    resumed = launch(profile, engine(*args, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]  # the redone step 3 is written once
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").num_parameters() > 0
    return out


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory, qwen2_model, reward_model) -> dict[str, Path]:
    """Output dirs of `crash_then_resume`, one per profile, made when first asked for."""
    cache: dict[str, Path] = {}

    def get(profile: str) -> Path:
        if profile not in cache:
            cache[profile] = crash_then_resume(profile, tmp_path_factory.mktemp(profile), qwen2_model, reward_model)
        return cache[profile]

    return get


@pytest.mark.parametrize("profile", ["deepspeed_zero2", "deepspeed_zero3"])
def test_zero_profile_trains_resumes_and_matches_ddp(profile, resumed_runs, ddp_run):
    out = resumed_runs(profile)
    assert all(r["grad_norm"] > 0 for r in read_metrics(out))  # DeepSpeed's own global norm is reported
    # policy == reference at step 1; fp32 KL uses the decoding log-probs, within 1e-6 of a forward's
    assert abs(read_metrics(out)[0]["kl"]) < 1e-5
    assert max_abs_diff(final_weights(out), final_weights(ddp_run)) < ZERO_VS_DDP_ATOL


def test_zero3_ranks_are_real_and_resume_equals_the_straight_run(tmp_path, qwen2_model, reward_model, resumed_runs):
    resumed = resumed_runs("deepspeed_zero3")
    straight = tmp_path / "out"
    # Saving every step, two kept: saving must not change the result, and pruning must work on ZeRO state.
    args = train_args(qwen2_model, reward_model, prompt_file(tmp_path), straight, "--save_steps", "1",
                      "--save_total_limit", "2")
    proc = launch("deepspeed_zero3", digest_script(*args))
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((straight / f"digest-rank{r}.json").read_text()) for r in (0, 1)]
    # accelerate 1.15 alone reports process 0 of 1 on both ranks here; the engine must see the real group.
    assert [(d["rank"], d["dist_rank"], d["num_processes"], d["dist_world_size"]) for d in ranks] == [
        (0, 0, 2, 2), (1, 1, 2, 2)]
    assert [d["is_main_process"] for d in ranks] == [True, False]
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert {d["distributed_type"] for d in ranks} == {"DEEPSPEED"}  # not silently swapped for DDP
    assert torch.equal(torch.cat([w.flatten() for w in final_weights(resumed).values()]),
                       torch.cat([w.flatten() for w in final_weights(straight).values()]))


def test_zero3_with_lora_merges_the_gathered_adapters(tmp_path, qwen2_model, reward_model):
    out = tmp_path / "out"
    proc = launch("deepspeed_zero3", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), out, *LORA,
                                                         "--save_merged_model")))
    assert_lora_run_merged(proc, out, qwen2_model)


def assert_lora_run_merged(proc, out: Path, base_model: Path) -> None:
    """A LoRA run on `LORA`'s modules with save_merged_model: adapters in its checkpoint and final/, and final-merged/
    differing from the base in those modules' weights only."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    base, final = load_file(Path(base_model) / "model.safetensors"), final_weights(out, "final-merged")
    changed = {k for k in base if not torch.equal(base[k], final[k])}
    assert changed and all(("q_proj" in k or "v_proj" in k) and k.endswith("weight") for k in changed), changed


def test_zero3_with_bf16_and_a_reference_synced_through_gathered_shards(tmp_path, qwen2_model, reward_model):
    """alpha 1, every step: the reference becomes the policy after each step, so every step's KL is 0.

    Under ZeRO-3 both models are shards; a sync that did not gather them would change nothing.
    """
    out = tmp_path / "out"
    sync = ["--sync_ref_model", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "1.0"]
    proc = launch("deepspeed_zero3", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), out,
                                                         "--bf16", "--max_steps", "3", *sync)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["kl"] for r in rows] == [0.0, 0.0, 0.0]
    final = final_weights(out)
    assert next(iter(final.values())).dtype == torch.bfloat16  # DeepSpeed's 16-bit gathered weights
    base = load_file(Path(qwen2_model) / "model.safetensors")
    assert max_abs_diff(final, {k: base[k].to(torch.bfloat16) for k in final}) > 0  # the policy did move


def test_a_combination_deepspeed_cannot_run_on_cpu_is_refused_by_name(tmp_path, qwen2_model, reward_model):
    proc = launch("deepspeed_zero2", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path),
                                                         tmp_path / "out", "--fp16")))
    assert proc.returncode != 0
    assert "launch profile deepspeed-zero2: fp16 needs a GPU" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_deepspeed_profile_that_accelerate_would_run_as_ddp_is_refused(tmp_path, qwen2_model, reward_model,
                                                                          monkeypatch):
    # ACCELERATE_USE_CPU (or --cpu) makes accelerate set up MULTI_CPU, i.e. plain DDP, under a DeepSpeed profile.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    proc = launch("deepspeed_zero2", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path),
                                                         tmp_path / "out")))
    assert proc.returncode != 0
    assert "launch profile deepspeed-zero2: accelerate set up MULTI_CPU instead of DEEPSPEED" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_zero3_trains_a_mixture_of_experts_with_its_load_balancing_loss(tmp_path, reward_model):
    from rloo_engine.testing.tiny_chat_models import build_family_model

    model, out = build_family_model(tmp_path / "moe", "qwen2_moe"), tmp_path / "out"
    proc = launch("deepspeed_zero3", engine(*train_args(model, reward_model, prompt_file(tmp_path), out)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["aux_loss"] > 0 for r in rows)
