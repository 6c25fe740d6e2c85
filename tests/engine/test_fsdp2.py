"""FSDP2 for real: 2 CPU processes (gloo), the shipped deployments/accelerate/fsdp2.yaml as it is.

accelerate selects FSDP only for GPU-like backends; on CPU the engine selects it itself (distributed.select_fsdp2)
and the rest is accelerate's own FSDP2 path: `fully_shard` per decoder layer, DTensor shards, torch distributed
checkpoints. The plain DDP run of test_deepspeed.py (same config and seed) is the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rloo_engine.run.checkpoint import validate_checkpoint
from tests.engine.helpers import prompt_file, read_metrics
from tests.engine.test_deepspeed import (  # noqa: F401  (ddp_run: the fixture, shared)
    LORA,
    PROFILES,
    assert_lora_run_merged,
    ddp_run,
    digest_script,
    engine,
    final_weights,
    launch,
    max_abs_diff,
    train_args,
)

pytestmark = pytest.mark.slow

# FSDP2 reduce-scatters gradients (DDP all-reduces them), so float32 sums differ in the last bits; the final
# weights after 4 steps differed by 4e-7 here. 1e-5 is 1/400 of the 4e-3 the weights move in these 4 steps.
FSDP2_VS_DDP_ATOL = 1e-5


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, qwen2_model, reward_model) -> Path:
    """4 steps under fsdp2.yaml, saving every step with two kept (saving must not change the result)."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    out = tmp / "out"
    args = train_args(qwen2_model, reward_model, prompt_file(tmp), out, "--save_steps", "1", "--save_total_limit", "2")
    proc = launch("fsdp2", digest_script(*args))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_fsdp2_ranks_are_real_shards_and_match_ddp(straight_run, ddp_run):  # noqa: F811 (the fixture)
    ranks = [json.loads((straight_run / f"digest-rank{r}.json").read_text()) for r in (0, 1)]
    assert [(d["rank"], d["dist_rank"], d["num_processes"]) for d in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert {d["distributed_type"] for d in ranks} == {"FSDP"}  # not silently run as MULTI_CPU (DDP)
    assert ranks[0]["digest"] == ranks[1]["digest"]  # the gathered parameters are one model
    for d in ranks:  # reference and reward model: each rank holds its half after their last forward, nothing whole
        assert len(d["frozen_held"]) == 2
        for held, total in zip(d["frozen_held"], d["frozen_total"]):
            assert held <= 0.51 * total, (held, total)
        assert d["head_whole_after_forward"]  # the policy's tail group as accelerate set it, after generations
    rows = read_metrics(straight_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["grad_norm"] > 0 for r in rows)
    assert abs(rows[0]["kl"]) < 1e-6  # policy == reference at step 1
    assert max_abs_diff(final_weights(straight_run), final_weights(ddp_run)) < FSDP2_VS_DDP_ATOL
    ddp_rows = read_metrics(ddp_run)
    for ours, theirs in zip(rows, ddp_rows, strict=True):
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)  # the global norm, not a shard's
        assert ours["kl"] == pytest.approx(theirs["kl"], abs=1e-6)
    assert sorted(p.name for p in straight_run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    state = straight_run / "checkpoint-3" / "accelerate"
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):  # torch distributed checkpoints, one file per rank
        assert sorted(p.name for p in (state / name).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(straight_run / "final").num_parameters() > 0


def test_fsdp2_resumes_exactly_after_a_crash(tmp_path, qwen2_model, reward_model, straight_run):
    out = tmp_path / "out"
    args = train_args(qwen2_model, reward_model, prompt_file(tmp_path), out)
    first = launch("fsdp2", engine(*args), crash_at=3)
    assert "RLOO_ENGINE_CRASH_AT_STEP=3 reached" in first.stderr, first.stderr[-4000:]
    resumed = launch("fsdp2", engine(*args, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    straight, again = final_weights(straight_run), final_weights(out)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)


def test_a_kill_inside_a_sharded_save_leaves_the_previous_checkpoint_usable(tmp_path, qwen2_model, reward_model,
                                                                           straight_run):
    out = tmp_path / "out"
    args = train_args(qwen2_model, reward_model, prompt_file(tmp_path), out, "--save_steps", "1")
    # SIGKILL on both ranks after the distributed checkpoint of step 3 is written, before its HF weights.
    killed = launch("fsdp2", engine(*args), env={"RLOO_ENGINE_KILL_AT": "3:checkpoint-partial"})
    assert killed.returncode != 0 and "RLOO_ENGINE_KILL_AT=3:checkpoint-partial reached" in killed.stderr
    assert (out / ".tmp-checkpoint-3" / "accelerate" / "optimizer_0" / ".metadata").is_file()
    assert validate_checkpoint(out / "checkpoint-2", 2, "fsdp") is None
    # What validation says of a damaged distributed checkpoint (a copy of checkpoint-2, so resume stays clean).
    broken = tmp_path / "broken"
    shutil.copytree(out / "checkpoint-2", broken)
    shard = broken / "accelerate" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "accelerate/pytorch_model_fsdp_0 has __1_0.distcp truncated" in validate_checkpoint(broken, 2, "fsdp")
    shutil.copy(out / "checkpoint-2" / "accelerate" / "pytorch_model_fsdp_0" / "__1_0.distcp", shard)
    (broken / "accelerate" / "optimizer_0" / ".metadata").unlink()
    assert "accelerate/optimizer_0 has no .metadata" in validate_checkpoint(broken, 2, "fsdp")
    resumed = launch("fsdp2", engine(*args, "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert not (out / ".tmp-checkpoint-3").exists()
    straight, again = final_weights(straight_run), final_weights(out)
    assert all(torch.equal(straight[k], again[k]) for k in straight)


def test_fsdp2_resumes_onto_fewer_processes_through_the_distributed_checkpoint(tmp_path, qwen2_model, reward_model,
                                                                               straight_run):
    """DCP reshards on load: a 2-process checkpoint resumes on 1 process (the optimizer state too). Onto more processes
    than wrote it, the per-process files (RNG, generation buffer) are missing, and validation says so."""
    out = tmp_path / "out"
    shutil.copytree(straight_run, out, ignore=shutil.ignore_patterns("final", "checkpoint-3", "digest-*"))
    args = train_args(qwen2_model, reward_model, prompt_file(tmp_path), out, "--save_steps", "1")
    resumed = launch("fsdp2", engine(*args, "--resume_from_checkpoint", "latest"), processes=1)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {out / 'checkpoint-2'} at step 2" in resumed.stderr
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert max_abs_diff(final_weights(out, "checkpoint-2"), final_weights(out)) > 0  # it trained on from there
    problem = validate_checkpoint(out / "checkpoint-3", 2, "fsdp")  # written by this 1-process run
    assert "random_states_1.pkl is missing; it was written by a run with fewer processes than this one (2)" in problem


def test_fsdp2_with_lora_and_gradient_checkpointing_merges_the_gathered_adapters(tmp_path, qwen2_model, reward_model):
    out = tmp_path / "out"
    proc = launch("fsdp2", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), out, *LORA,
                                               "--gradient_checkpointing", "true", "--save_merged_model")))
    assert_lora_run_merged(proc, out, qwen2_model)


def test_fsdp2_with_bf16_and_a_reference_synced_shard_by_shard(tmp_path, qwen2_model, reward_model):
    """alpha 1, every step: the reference becomes the policy after each step, so the KL after it is ~0 (the sampler's
    float32 log-probs against a bf16 forward would differ by far more than the tolerance if the sync were lost:
    the unsynced run's step-2 KL is ~1e-3)."""
    out = tmp_path / "out"
    sync = ["--sync_ref_model", "--ref_model_sync_steps", "1", "--ref_model_mixup_alpha", "1.0"]
    proc = launch("fsdp2", engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), out, "--bf16",
                                               "--max_steps", "3", *sync)))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(abs(r["kl"]) < 1e-5 for r in rows), [r["kl"] for r in rows]
    # FSDP2's mixed precision computes in bf16 on float32 parameters, so the saved weights are float32.
    assert next(iter(final_weights(out).values())).dtype == torch.float32


def test_an_fsdp1_profile_is_refused_by_name(tmp_path, qwen2_model, reward_model):
    profile = yaml.safe_load((PROFILES / "fsdp2.yaml").read_text())
    profile["fsdp_config"]["fsdp_version"] = 1
    fsdp1 = tmp_path / "fsdp1.yaml"
    fsdp1.write_text(yaml.safe_dump(profile))
    proc = launch(fsdp1, engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), tmp_path / "out")))
    assert proc.returncode != 0
    assert "launch profile fsdp1: FSDP1 is not supported by rloo-engine; set fsdp_config.fsdp_version: 2" in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_cpu_offload_is_refused_by_name_on_a_machine_without_an_accelerator(tmp_path, qwen2_model, reward_model):
    profile = yaml.safe_load((PROFILES / "fsdp2.yaml").read_text())
    profile["fsdp_config"]["fsdp_offload_params"] = True
    offload = tmp_path / "fsdp2_offload.yaml"
    offload.write_text(yaml.safe_dump(profile))
    proc = launch(offload, engine(*train_args(qwen2_model, reward_model, prompt_file(tmp_path), tmp_path / "out")))
    assert proc.returncode != 0
    assert "launch profile fsdp2: fsdp_offload_params: true needs a GPU" in proc.stderr, proc.stderr[-3000:]


def test_a_process_sent_its_weights_builds_its_models_without_reading_them(tmp_path, qwen2_model, reward_model):
    """fsdp2.yaml's `fsdp_cpu_ram_efficient_loading`: every process but the main one builds the policy, reference and
    reward model empty (`distributed.loads_weights`) and is sent its shards as each is sharded. Shown here on copies
    of the checkpoints without their weight files: nothing is read, the parameters are on the meta device, and what
    is not sent (tied head, rotary tables, generation config) is as `from_pretrained` makes it."""
    from transformers import AutoModelForCausalLM

    from rloo_engine.cli import parse_train_args
    from rloo_engine.models import load_policy, load_reference
    from rloo_engine.reward_sources import RewardModelSource, build_reward_sources

    copies = []
    for source in (qwen2_model, reward_model):
        copy = tmp_path / source.name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("*.safetensors"))
        copies.append(copy)
    cfg = parse_train_args(train_args(*copies, prompt_file(tmp_path), tmp_path / "out"))
    policy, ref = load_policy(cfg, weights=False), load_reference(cfg, weights=False)
    (scorer,) = build_reward_sources(cfg, "cpu", weights=False)
    assert isinstance(scorer, RewardModelSource)
    for model in (policy, ref, scorer.model):
        assert all(p.is_meta for p in model.parameters())
    loaded = AutoModelForCausalLM.from_pretrained(qwen2_model)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight  # tied, so FSDP2 maps one parameter
    assert torch.equal(policy.model.rotary_emb.inv_freq, loaded.model.rotary_emb.inv_freq)  # not meta: not sent
    assert policy.generation_config.eos_token_id == loaded.generation_config.eos_token_id
    lora = parse_train_args(train_args(*copies, prompt_file(tmp_path), tmp_path / "out", *LORA))
    assert all(p.is_meta for p in load_policy(lora, weights=False).parameters())  # adapters come from rank 0 too


def test_a_sender_that_fails_part_way_through_a_sharded_pass_leaves_no_rank_waiting(tmp_path):
    """Server mode under FSDP2: rank 0 gathers each parameter as it sends it, the other ranks alongside. A send that
    fails part way makes the rest of the pass's gathers (`finish_pass`), so the run can fail on every rank instead
    of hanging; the next pass is whole."""
    from rloo_engine.services import free_port
    from tests.engine.helpers import REPO, repo_pythonpath

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(REPO / "tests/engine/scripts/sharded_weight_pass.py"), str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["sharded"] and second["sharded"]
    assert first["gathered_before_finish"] == 3 and second["gathered_before_finish"] == 0
    assert first["max_diff"] == 0.0  # the shards gathered one at a time are the model
    tied = [first["names"][i] for i, j in enumerate(first["same_as"]) if i != j]
    assert tied == ["lm_head.weight"]  # found from the local shards, without a gather
