"""A `trl rloo` command line or YAML file means the same run here: TRL's own parser (in .venv-trl) against ours.

Every field TRL parses must be classified in rloo_engine/trl_fields.py. On TRL's documented command lines and a
TRL YAML file, each field classified `same` must come out equal, each `different` one as its note maps it, and
TRL's documented command must train as many steps here as TRL's RLOOTrainer computes for it.

TRL runs in its own venv (`bash bench/setup_trl_venv.sh`, or RLOO_TRL_VENV). Without it the test skips locally;
CI sets RLOO_REQUIRE_TRL=1, so there a missing venv fails instead of hiding the check.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from rloo_engine.cli import parse_train_command
from rloo_engine.config import RLOOConfig
from rloo_engine.testing import tiny_models
from rloo_engine.trl_fields import DEFAULT_DIFFERENCES, TRL_FIELDS

REPO = Path(__file__).resolve().parents[2]
TRL_VENV = Path(os.environ.get("RLOO_TRL_VENV", REPO / ".venv-trl"))
TRL_PYTHON = TRL_VENV / "bin" / "python"

# TRL needs --use_cpu on a machine without bf16 (its default bf16 is true); a CPU user of `trl rloo` passes it.
SEED = ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/ultrafeedback-prompt",
        "--reward_funcs", "my_rewards.length_reward", "--per_device_train_batch_size", "64", "--num_generations", "4",
        "--learning_rate", "3e-6", "--output_dir", "Qwen2-0.5B-RLOO", "--use_cpu"]
COMMAND_LINES = {
    "seed command": SEED,
    "lora": [*SEED, "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.0",
             "--lora_target_modules", "q_proj", "v_proj"],
    "bf16 and checkpointing": [*SEED, "--bf16", "true", "--gradient_checkpointing", "false", "--disable_dropout"],
    "dashed spellings and --no_": [*SEED, "--num-train-epochs", "2", "--max-completion-length", "128",
                                   "--no_shuffle_dataset", "--warmup-steps", "0.1", "--report_to", "none"],
    "vllm colocate": [*SEED, "--use_vllm", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.5",
                      "--vllm_tensor_parallel_size", "1", "--vllm_enable_sleep_mode"],
    "vllm server": [*SEED, "--use_vllm", "--vllm_mode", "server", "--vllm_server_base_url", "http://10.0.0.5:8000",
                    "--vllm_server_timeout", "60"],
}
# A TRL config file as its docs write them: TRL's own defaults spelt out, a tracker, checkpointing kwargs, `env`.
TRL_YAML = {
    "model_name_or_path": "Qwen/Qwen2-0.5B-Instruct", "dataset_name": "trl-lib/ultrafeedback-prompt",
    "reward_funcs": ["my_rewards.length_reward"], "output_dir": "out", "report_to": "none",
    "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4,
    "num_train_epochs": 1, "learning_rate": 1.0e-6, "lr_scheduler_type": "cosine", "warmup_steps": 0.05,
    "logging_steps": 5, "save_steps": 50, "bf16": False, "use_cpu": True, "push_to_hub": False,
    "eval_strategy": "no", "logging_strategy": "steps", "save_strategy": "steps", "dataloader_num_workers": 2,
    "beta": 0.0, "max_completion_length": 256, "env": {"RLOO_TRL_PARITY_ENV": "1"},
}


def _empty(value):
    """TRL's None and our empty list/dict mean the same (no reward functions, no extra kwargs); TRL's top_k 0 is off."""
    return None if value in (None, [], {}, ()) else list(value) if isinstance(value, tuple) else value


def expected_here(name: str, trl_value, given: set[str]):
    """What our config should hold for TRL's `trl_value` of field `name` (the documented mapping of `different`)."""
    target = TRL_FIELDS[name].ours or name
    if target in DEFAULT_DIFFERENCES and not {name, target} & given:
        return DEFAULT_DIFFERENCES[target][0]
    if name == "reward_funcs" and trl_value:
        return [f.rpartition(".")[0] + ":" + f.rpartition(".")[2] for f in trl_value]
    if name == "report_to":
        names = [trl_value] if isinstance(trl_value, str) else trl_value
        return ["mlflow"] if "report_to" not in given else [] if names == ["none"] else names
    if name == "top_k" and trl_value == 0:
        return None
    return trl_value


def ours_for(name: str, command) -> object:
    entry = TRL_FIELDS[name]
    if name == "use_cpu":
        return command.use_cpu
    if name == "steps_per_generation":  # TRL resolves both in its config; ours when the run knows its processes
        return command.config.steps_per_generation_for(num_processes=1)
    if name == "generation_batch_size":
        return command.config.per_device_train_batch_size * command.config.steps_per_generation_for(num_processes=1)
    if name == "warmup_steps":
        return command.config.warmup_steps + command.config.warmup_ratio  # TRL's fraction is our warmup_ratio
    return getattr(command.config, entry.ours or name)


def require_trl() -> None:
    if not TRL_PYTHON.exists():
        message = (f"TRL's venv {TRL_VENV} is missing; build it with `bash bench/setup_trl_venv.sh` "
                   "(or point RLOO_TRL_VENV at one)")
        if os.environ.get("RLOO_REQUIRE_TRL") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def trl_parse():
    require_trl()

    def run(requests: list[dict]) -> dict:
        proc = subprocess.run([str(TRL_PYTHON), str(REPO / "tests/engine/scripts/trl_parse.py")],
                              input=json.dumps(requests), capture_output=True, text=True, timeout=600,
                              env=trl_environment())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)

    return run


def trl_environment() -> dict[str, str]:
    """TRL's venv is a world of its own: without our PYTHONPATH (the transformers-overlay lane puts an older
    transformers first on it, which TRL's venv must not import) and without GPUs."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def trl_answers(trl_parse, tmp_path_factory):
    """TRL's parse of every command line and of the YAML file, and its step count for the seed command."""
    tmp = tmp_path_factory.mktemp("trl")
    config_file = tmp / "trl.yaml"
    config_file.write_text(yaml.safe_dump(TRL_YAML))
    model = tiny_models.build_causal_lm(tmp / "policy", tiny_models.train_tokenizer(), arch="qwen2")
    prompts = tiny_models.write_prompt_file(tmp / "prompts.jsonl", num_prompts=576)
    # The seed command on a real (tiny) model and a 576-prompt file, for TRL's own step count.
    steps_argv = [*SEED, "--model_name_or_path", str(model), "--dataset_name", str(prompts),
                  "--output_dir", str(tmp / "steps")]
    cases = {**COMMAND_LINES, "yaml": ["--config", str(config_file)],
             "yaml with flags": ["--config", str(config_file), "--learning_rate", "2e-6", "--num-generations", "8"]}
    requests = [{"argv": argv} for argv in cases.values()]
    requests.append({"argv": steps_argv, "steps_for": {"model": str(model), "prompts": str(prompts)}})
    reply = trl_parse(requests)
    answers = reply["answers"]
    return {"cases": dict(zip(cases, answers[:-1])), "argv": cases, "steps": answers[-1], "steps_argv": steps_argv,
            "defaults": reply["defaults"]}


def test_every_trl_field_is_classified(trl_answers):
    trl_fields = set(trl_answers["cases"]["seed command"]["fields"])
    missing = sorted(trl_fields - set(TRL_FIELDS))
    assert not missing, f"TRL fields with no row in rloo_engine/trl_fields.py: {missing}"
    stale = sorted(set(TRL_FIELDS) - trl_fields)
    assert not stale, f"rows in rloo_engine/trl_fields.py for fields TRL no longer has: {stale}"


def test_the_table_agrees_with_the_config():
    ours = set(RLOOConfig.model_fields)
    for name, entry in TRL_FIELDS.items():
        implemented = name in ours or (entry.ours or "") in ours or name == "use_cpu"
        if entry.kind in ("same", "different"):
            assert implemented, f"{name} is classified {entry.kind} but RLOOConfig has no such field"
        else:
            assert not implemented, f"{name} is an RLOOConfig field but classified {entry.kind}"
            assert entry.note, f"{name} is {entry.kind} without a reason"


def test_refused_fields_accept_exactly_trls_default(trl_answers):
    defaults = trl_answers["defaults"]
    for name, entry in TRL_FIELDS.items():
        if entry.kind == "refused":
            assert entry.trl_default == defaults[name], f"{name}: TRL's default is {defaults[name]!r}"


@pytest.mark.parametrize("case", [*COMMAND_LINES, "yaml", "yaml with flags"])
def test_trl_command_lines_mean_the_same_here(trl_answers, case, capsys):
    trl = trl_answers["cases"][case]["fields"]
    command = parse_train_command(trl_answers["argv"][case])
    given = command.given | {k for k in TRL_YAML if case.startswith("yaml")}
    mismatched = {}
    for name, trl_value in trl.items():
        entry = TRL_FIELDS[name]
        if entry.kind not in ("same", "different"):
            continue
        want, got = _empty(expected_here(name, trl_value, given)), _empty(ours_for(name, command))
        if want != got:
            mismatched[name] = f"TRL {trl_value!r}, here {got!r} (expected {want!r})"
    assert not mismatched, json.dumps(mismatched, indent=1)
    if case.startswith("yaml"):
        assert command.env == {"RLOO_TRL_PARITY_ENV": "1"}
        assert "dataloader_num_workers" in capsys.readouterr().err  # ignored, and said so


def test_trls_documented_command_trains_as_many_steps_here(trl_answers):
    """576 prompts, 64 completions per step, G=4, no --max_steps: 3 epochs of 36 steps in TRL, and here."""
    trl_steps = trl_answers["steps"]["max_steps"]
    cfg = parse_train_command(trl_answers["steps_argv"]).config
    assert trl_steps == 108
    assert cfg.total_steps_for(dataset_size=576, num_processes=1) == trl_steps



def test_eval_metric_names_are_trls(tmp_path, qwen2_model):
    """TRL's RLOOTrainer evaluating during training (in .venv-trl) against ours on the same model and prompts:
    every eval metric TRL logs about completions, rewards and KL is logged here under the same name."""
    from tests.engine.helpers import prompt_file

    require_trl()
    prompts = prompt_file(tmp_path)
    proc = subprocess.run([str(TRL_PYTHON), str(REPO / "tests/engine/scripts/trl_eval_names.py"), str(qwen2_model),
                           str(prompts), str(tmp_path / "trl")], capture_output=True, text=True, timeout=600,
                          env=trl_environment())
    assert proc.returncode == 0, proc.stderr[-3000:]
    trl_names = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    from rloo_engine import RLOOTrainer
    from tests.engine.helpers import prompt_file, read_metrics, tiny_config

    cfg = tiny_config(tmp_path, qwen2_model, max_steps=1, beta=0.05, eval_strategy="steps", eval_steps=1,
                      per_device_eval_batch_size=4, num_generations_eval=2)
    import datasets

    RLOOTrainer(cfg, eval_dataset=datasets.load_dataset("json", data_files=str(prompts), split="train").select(
        range(4))).train()
    ours = {k for row in read_metrics(cfg.output_dir) for k in row if k.startswith("eval_")}
    # About the policy's completions: TRL's names, all of them here. Trainer bookkeeping (eval_loss of a forward
    # with no labels, steps per second, the training forward's entropy and clip ratios) is TRL's own.
    about_completions = {n for n in trl_names if n.startswith(("eval_reward", "eval_rewards/", "eval_kl",
                                                               "eval_completions/", "eval_frac_reward_zero_std"))}
    assert about_completions and about_completions <= ours, sorted(about_completions - ours)
    assert "eval_runtime" in trl_names and "eval_runtime" in ours and "eval_samples_per_second" in ours
