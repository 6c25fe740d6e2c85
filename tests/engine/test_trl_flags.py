"""TRL's loading, optimiser, logging, LoRA, GPU-only, DeepSpeed and vLLM options (issue 42): each one changes the run."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from rloo_engine.config_base import ConfigError
from rloo_engine.generation.base import SamplingParams
from rloo_engine.machine_flags import apply_machine_flags, check_deepspeed_json, check_machine_flags
from rloo_engine.models import load_causal_lm, load_policy, lora_config, model_init_kwargs
from rloo_engine.optim import build_optimizer, build_scheduler
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import REPO, read_metrics, repo_pythonpath, tiny_config


# ---------------------------------------------------------------- model_init_kwargs, trust_remote_code, model_revision
def test_model_init_kwargs_set_their_own_options_and_pass_the_rest_to_from_pretrained(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, model_init_kwargs={"torch_dtype": "bfloat16", "low_cpu_mem_usage": True,
                                                                "attn_implementation": "eager"})
    assert (cfg.dtype, cfg.attn_implementation, cfg.model_init_kwargs) == ("bfloat16", "eager",
                                                                          {"low_cpu_mem_usage": True})
    kwargs = model_init_kwargs(cfg)
    assert kwargs == {"low_cpu_mem_usage": True, "revision": "main", "trust_remote_code": False,
                      "dtype": torch.bfloat16, "attn_implementation": "eager"}
    assert load_causal_lm(cfg.model_name_or_path, cfg).dtype == torch.bfloat16
    # TRL's CLI passes it as JSON text
    assert tiny_config(tmp_path, qwen2_model, model_init_kwargs='{"revision": "v1"}').model_revision == "v1"


def test_model_init_kwargs_that_contradict_an_option_or_place_the_model_are_refused(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match=r"model_init_kwargs.dtype: 'bfloat16' conflicts with dtype: 'float32'"):
        tiny_config(tmp_path, qwen2_model, dtype="float32", model_init_kwargs={"dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"model_init_kwargs.device_map: 'auto'; accelerate places"):
        tiny_config(tmp_path, qwen2_model, model_init_kwargs={"device_map": "auto"})
    with pytest.raises(ConfigError, match=r"model_init_kwargs: '\{oops' is not JSON"):
        tiny_config(tmp_path, qwen2_model, model_init_kwargs="{oops")
    # the same value in both places is one setting, not a conflict
    assert tiny_config(tmp_path, qwen2_model, dtype="float32", model_init_kwargs={"dtype": "float32"}).dtype == "float32"


CUSTOM_CONFIG = '''from transformers import Qwen2Config


class TinyCustomConfig(Qwen2Config):
    model_type = "tiny_custom"
'''
CUSTOM_MODEL = '''from transformers import Qwen2ForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(Qwen2ForCausalLM):
    config_class = TinyCustomConfig
'''


def custom_code_model(src: Path, out: Path) -> Path:
    """`src` re-declared as a model whose architecture exists only in Python files shipped beside its weights."""
    shutil.copytree(src, out)
    (out / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (out / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_model_with_its_own_code_loads_and_trains_only_with_trust_remote_code(tmp_path, qwen2_model):
    model = custom_code_model(qwen2_model, tmp_path / "custom")
    refused = tiny_config(tmp_path, model)
    with pytest.raises(ConfigError, match="trust_remote_code"):
        load_causal_lm(refused.model_name_or_path, refused)
    cfg = tiny_config(tmp_path, model, trust_remote_code=True, max_steps=1, beta=0.05)
    trainer = RLOOTrainer(cfg)
    assert type(trainer.acc.unwrap_model(trainer.policy)).__name__ == "TinyCustomForCausalLM"
    assert type(trainer.ref).__name__ == "TinyCustomForCausalLM"
    assert trainer.train().global_step == 1


REVISION_PROBE = """
import json, sys
from rloo_engine.config import build_config
from rloo_engine.models import load_causal_lm, load_tokenizer
from rloo_engine.config_base import ConfigError
values = dict(model_name_or_path="org/tiny", dataset_name="unused.jsonl", reward_funcs=["m:f"], model_revision=sys.argv[1])
cfg = build_config(values)
try:
    model = load_causal_lm(cfg.model_name_or_path, cfg)
    load_tokenizer(cfg.model_name_or_path, cfg)
    print(json.dumps({"layers": model.config.num_hidden_layers}))
except ConfigError as err:
    print(json.dumps({"error": str(err)}))
"""


def hub_cache_with_two_revisions(cache: Path, main_model: Path, v2_model: Path) -> None:
    """A hub cache as `huggingface_hub` lays it out: `main` and `v2` name two snapshots of org/tiny."""
    repo = cache / "models--org--tiny"
    for ref, commit, files in (("main", "a" * 40, main_model), ("v2", "b" * 40, v2_model)):
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        shutil.copytree(files, repo / "snapshots" / commit)


def test_model_revision_picks_the_snapshot_from_pretrained_loads(tmp_path, qwen2_model, policy_tokenizer):
    from rloo_engine.testing.tiny_models import build_causal_lm

    v2 = build_causal_lm(tmp_path / "v2", policy_tokenizer, layers=3)
    hub_cache_with_two_revisions(tmp_path / "hub", qwen2_model, v2)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": repo_pythonpath()}

    def probe(revision: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", REVISION_PROBE, revision], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    assert probe("main") == {"layers": 2}
    assert probe("v2") == {"layers": 3}
    assert "at model_revision 'nope'" in probe("nope")["error"]


# ---------------------------------------------------------------- gradient_checkpointing_kwargs
def checkpoint_keywords(model: torch.nn.Module) -> dict:
    funcs = [m._gradient_checkpointing_func for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert funcs, "no layer is checkpointed"
    return funcs[0].keywords


def test_gradient_checkpointing_kwargs_reach_torch_checkpoint(tmp_path, qwen2_model):
    default = tiny_config(tmp_path, qwen2_model, gradient_checkpointing=True)
    assert checkpoint_keywords(load_policy(default)) == {"use_reentrant": False}
    given = tiny_config(tmp_path, qwen2_model, gradient_checkpointing=True,
                        gradient_checkpointing_kwargs={"use_reentrant": True, "preserve_rng_state": False})
    assert checkpoint_keywords(load_policy(given)) == {"use_reentrant": True, "preserve_rng_state": False}
    with pytest.raises(ConfigError, match="gradient_checkpointing_kwargs: .* with gradient_checkpointing: false"):
        tiny_config(tmp_path, qwen2_model, gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['reentrant'\]"):
        tiny_config(tmp_path, qwen2_model, gradient_checkpointing=True, gradient_checkpointing_kwargs={"reentrant": 1})


# ---------------------------------------------------------------- optim, adam_epsilon, lr_scheduler_kwargs
def test_optim_builds_the_named_optimizer(tmp_path, qwen2_model):
    params = [torch.nn.Parameter(torch.zeros(3))]
    fused = build_optimizer(tiny_config(tmp_path, qwen2_model, adam_epsilon=1e-6), params)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] and fused.defaults["eps"] == 1e-6
    plain = build_optimizer(tiny_config(tmp_path, qwen2_model, optim="adamw_torch"), params)
    assert isinstance(plain, torch.optim.AdamW) and not plain.defaults["fused"]
    adafactor = build_optimizer(tiny_config(tmp_path, qwen2_model, optim="adafactor"), params)
    assert isinstance(adafactor, transformers.optimization.Adafactor)
    assert (adafactor.defaults["relative_step"], adafactor.defaults["scale_parameter"]) == (False, False)
    with pytest.raises(ConfigError, match=r"optim: .*'adamw_torch_fused', 'adamw_torch' or 'adafactor'"):
        tiny_config(tmp_path, qwen2_model, optim="adamw_8bit")


def test_lr_scheduler_kwargs_shape_the_schedule_and_unknown_keys_are_refused(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, lr_scheduler_type="cosine_with_min_lr",
                      lr_scheduler_kwargs={"min_lr_rate": 0.5}, learning_rate=1.0)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(cfg, sgd, 10)
    for _ in range(10):
        sgd.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.5)  # the floor min_lr_rate sets; without it 0
    with pytest.raises(ConfigError, match=r"lr_scheduler_kwargs: .* has \['num_cycle'\], which lr_scheduler_type "
                                          r"'cosine' does not take; expected some of \['num_cycles'\]"):
        tiny_config(tmp_path, qwen2_model, lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycle": 2})
    with pytest.raises(ConfigError, match="'constant' does not take; expected no keyword arguments"):
        tiny_config(tmp_path, qwen2_model, lr_scheduler_type="constant", lr_scheduler_kwargs={"power": 2})


def test_a_run_with_adafactor_a_scheduler_kwarg_and_logging_first_step(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, optim="adafactor", lr_scheduler_type="polynomial",
                      lr_scheduler_kwargs={"power": 2.0, "lr_end": 1e-4}, learning_rate=1e-2, logging_steps=3,
                      logging_first_step=True)
    trainer = RLOOTrainer(cfg)
    assert isinstance(trainer.optimizer.optimizer, transformers.optimization.Adafactor)
    before = {n: p.detach().clone() for n, p in trainer.acc.unwrap_model(trainer.policy).named_parameters()}
    trainer.train()
    after = dict(trainer.acc.unwrap_model(trainer.policy).named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    rows = read_metrics(cfg.output_dir)
    assert [r["step"] for r in rows] == [1, 3, 4]  # step 1 only because of logging_first_step
    # polynomial decay with power 2 from 1e-2 to 1e-4 over 4 steps; step 3 logs the mean of the rates steps 2 and 3
    # stepped with (k = 1, 2): power 1 (no kwargs) would give 6.3e-3
    rate = [(1e-2 - 1e-4) * (1 - k / 4) ** 2 + 1e-4 for k in range(4)]
    assert rows[1]["learning_rate"] == pytest.approx((rate[1] + rate[2]) / 2)


# ---------------------------------------------------------------- log_level, tf32, GPU-only options
def test_log_level_sets_transformers_verbosity_on_the_main_process(tmp_path, qwen2_model):
    before = transformers.logging.get_verbosity()
    try:
        apply_machine_flags(tiny_config(tmp_path, qwen2_model, log_level="error"), is_main_process=True)
        assert transformers.logging.get_verbosity() == logging.ERROR
        apply_machine_flags(tiny_config(tmp_path, qwen2_model, log_level="debug"), is_main_process=False)
        assert transformers.logging.get_verbosity() == logging.WARNING  # replicas keep warning
        transformers.logging.set_verbosity_info()
        apply_machine_flags(tiny_config(tmp_path, qwen2_model), is_main_process=True)  # passive
        assert transformers.logging.get_verbosity() == logging.INFO
    finally:
        transformers.logging.set_verbosity(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_tf32_true_without_an_ampere_gpu_is_refused_and_false_is_accepted(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="tf32: true needs an NVIDIA GPU of the Ampere generation"):
        check_machine_flags(tiny_config(tmp_path, qwen2_model, tf32=True))
    check_machine_flags(tiny_config(tmp_path, qwen2_model, tf32=False))


@pytest.mark.parametrize("field", ["load_in_4bit", "load_in_8bit", "use_liger_kernel"])
def test_gpu_only_options_are_refused_without_cuda_or_their_package(tmp_path, qwen2_model, field):
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, **{field: True})
    with pytest.raises(ConfigError, match=rf"^{field}: true needs a CUDA GPU .* set {field}: false here$"):
        check_machine_flags(cfg, has_cuda=False)
    package = "liger-kernel" if field == "use_liger_kernel" else "bitsandbytes"
    module = package.replace("-", "_")
    if not __import__("importlib.util").util.find_spec(module):
        with pytest.raises(ConfigError, match=rf"{field}: true needs the `{package}` package"):
            check_machine_flags(cfg, has_cuda=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_trainer_refuses_a_gpu_only_option_before_any_model_loads(tmp_path, qwen2_model, monkeypatch):
    import rloo_engine.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "load_policy", lambda cfg: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="use_liger_kernel: true needs a CUDA GPU"):
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, use_liger_kernel=True))


def test_quantisation_options_build_trls_bitsandbytes_config(tmp_path, qwen2_model, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, load_in_4bit=True, bnb_4bit_quant_type="fp4",
                      use_bnb_nested_quant=True, dtype="bfloat16")
    kwargs = model_init_kwargs(cfg)
    quantization = kwargs["quantization_config"]
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "fp4"
    assert quantization.bnb_4bit_use_double_quant and quantization.bnb_4bit_compute_dtype == torch.bfloat16
    assert kwargs["device_map"] == {"": 0}
    with pytest.raises(ConfigError, match="load_in_4bit: true without use_peft: true"):
        tiny_config(tmp_path, qwen2_model, load_in_4bit=True)
    with pytest.raises(ConfigError, match="use_bnb_nested_quant: set without load_in_4bit"):
        tiny_config(tmp_path, qwen2_model, use_bnb_nested_quant=True)


# ---------------------------------------------------------------- LoRA variants
def test_lora_options_reach_the_peft_config(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, use_rslora=True, use_dora=True,
                      lora_modules_to_save=["norm"])
    lora = lora_config(cfg)
    assert (lora.use_rslora, lora.use_dora, set(lora.modules_to_save), str(lora.task_type)) == (
        True, True, {"norm"}, "CAUSAL_LM")
    with pytest.raises(ConfigError, match="lora_task_type"):
        tiny_config(tmp_path, qwen2_model, lora_task_type="SEQ_CLS")


def test_a_dora_run_trains_the_magnitudes_and_the_modules_to_save(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, use_peft=True, use_dora=True, lora_modules_to_save=["norm"],
                      lora_target_modules=["q_proj", "v_proj"], max_steps=2, learning_rate=1e-2)
    trainer = RLOOTrainer(cfg)
    policy = trainer.acc.unwrap_model(trainer.policy)
    trainable = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    magnitudes = [n for n in trainable if "lora_magnitude_vector" in n]
    saved = [n for n in trainable if "modules_to_save" in n]
    assert magnitudes and saved
    trainer.train()
    now = dict(policy.named_parameters())
    assert all(not torch.equal(trainable[n], now[n]) for n in magnitudes + saved)


# ---------------------------------------------------------------- deepspeed
def test_a_deepspeed_json_without_a_deepspeed_launch_is_refused_with_the_command(tmp_path, qwen2_model):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}))
    cfg = tiny_config(tmp_path, qwen2_model, deepspeed=str(ds))
    with pytest.raises(ConfigError) as err:
        check_deepspeed_json(cfg, launched_zero_stage=None)
    assert f"accelerate launch --use_deepspeed --deepspeed_config_file {ds} --num_processes <GPUs> -m rloo_engine" \
        in str(err.value)
    with pytest.raises(ConfigError, match="has zero_optimization.stage 2, but the launch profile runs ZeRO stage 3"):
        check_deepspeed_json(cfg, launched_zero_stage=3)
    assert "agrees with the launch profile's ZeRO stage 2" in check_deepspeed_json(cfg, launched_zero_stage=2)
    with pytest.raises(ConfigError, match="deepspeed: .* does not exist"):
        tiny_config(tmp_path, qwen2_model, deepspeed=str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- vLLM: max_model_len and structured outputs
def test_vllm_max_model_length_and_structured_outputs_reach_vllm(tmp_path, qwen2_model):
    from rloo_engine.generation.vllm_colocate import colocate_max_model_len, sampling_kwargs
    from rloo_engine.generation.vllm_server import VLLMServerBackend

    params = SamplingParams(max_completion_length=16, max_prompt_length=64)
    assert colocate_max_model_len(params, position_limit=512) == 80
    assert colocate_max_model_len(params, position_limit=512, requested=200) == 200
    with pytest.raises(ConfigError, match="vllm_max_model_length: 600 exceeds the model's max_position_embeddings 512"):
        colocate_max_model_len(params, position_limit=512, requested=600)
    kwargs = sampling_kwargs(params, 4, [2], structured_outputs_regex=r"\d+")
    assert kwargs["structured_outputs"] == {"regex": r"\d+"} and kwargs["n"] == 4
    assert "structured_outputs" not in sampling_kwargs(params, 4, [2])

    server = VLLMServerBackend.__new__(VLLMServerBackend)  # the request body only: no server needed
    server.params, server.model_id, server.eos_ids, server.structured_outputs_regex = params, "m", [2], r"\d+"
    assert server._body([5, 6], 4, seed=1)["structured_outputs"] == {"regex": r"\d+"}


def test_vllm_options_are_checked_when_the_config_loads(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="vllm_structured_outputs_regex: .* without use_vllm: true"):
        tiny_config(tmp_path, qwen2_model, vllm_structured_outputs_regex="a+")
    with pytest.raises(ConfigError, match=r"vllm_structured_outputs_regex: '\(' is not a regular expression"):
        tiny_config(tmp_path, qwen2_model, use_vllm=True, vllm_structured_outputs_regex="(")
    with pytest.raises(ConfigError, match="vllm_max_model_length: 6; expected more than max_completion_length=6"):
        tiny_config(tmp_path, qwen2_model, use_vllm=True, vllm_max_model_length=6)


def test_weight_decay_spares_biases_and_norms_as_transformers_trainer_does(qwen2_model):
    from transformers import AutoModelForCausalLM, Trainer

    from rloo_engine.optim import parameter_groups

    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    decay, no_decay = parameter_groups(model, 0.1)
    model.requires_grad_(False)
    model.lm_head.weight.requires_grad_(True)  # as LoRA leaves it: nothing to exempt, so no empty group
    assert [g["weight_decay"] for g in parameter_groups(model, 0.1)] == [0.1]
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_by_trainer = set(Trainer.get_decay_parameter_names(None, model))  # its own rule (it does not use self)
    # by tensor, not name: a tied lm_head is the embedding's tensor under a second name
    expected = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in decayed_by_trainer}
    assert {id(p) for p in decay["params"]} == expected and decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0 and any("norm" in names[id(p)] for p in no_decay["params"])
