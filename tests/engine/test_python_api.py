"""TRL's Python API: `RLOOTrainer(model=..., reward_funcs=..., args=RLOOConfig(...), train_dataset=...)` with
objects where TRL takes them, callbacks, `train(resume_from_checkpoint=...)`, `save_model`, `state.log_history`."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

from rloo_engine import RLOOConfig, RLOOTrainer
from rloo_engine.config_base import ConfigError
from rloo_engine.run.fault_injection import CRASH_ENV
from tests.engine.helpers import async_length_reward, prompt_file, read_metrics, target_token_fraction, tiny_config

SMALL = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=6, max_prompt_length=16,
             learning_rate=1e-3, beta=0.0, max_steps=4, logging_steps=1, save_steps=0, disable_tqdm=True,
             disable_dropout=True, seed=0)


def args(tmp_path, **overrides) -> RLOOConfig:
    return RLOOConfig(output_dir=str(tmp_path / "out"), **{**SMALL, **overrides})


def prompts(tmp_path) -> datasets.Dataset:
    return datasets.load_dataset("json", data_files=str(prompt_file(tmp_path)), split="train")


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.acc.unwrap_model(trainer.policy).state_dict().items()}


def test_rloo_config_alone_is_a_valid_config_as_in_trl(tmp_path):
    """TRL users build `RLOOConfig(output_dir=...)` without model or data; the command line still requires them."""
    cfg = RLOOConfig(output_dir=str(tmp_path), learning_rate=1e-5)
    assert cfg.model_name_or_path is None and cfg.dataset_name is None
    from rloo_engine.config import build_config

    with pytest.raises(ConfigError, match="model_name_or_path: not set"):
        build_config({"dataset_name": "d.jsonl", "reward_funcs": ["a:b"]}, source="rloo-engine train")


def test_objects_train_exactly_as_the_paths_they_came_from(tmp_path, qwen2_model):
    """The same run three ways: config paths (`rloo-engine train`), a model id + a callable + a Dataset, and a
    model object + a Dataset. Same seed, same data: the same metrics and the same final weights."""
    common = dict(beta=0.05)
    by_config = RLOOTrainer(tiny_config(tmp_path / "a", qwen2_model, **{**SMALL, **common}))
    by_config.train()
    by_name = RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction,
                          args=args(tmp_path / "b", **common), train_dataset=prompts(tmp_path / "b"))
    by_name.train()
    by_object = RLOOTrainer(model=AutoModelForCausalLM.from_pretrained(qwen2_model),
                            reward_funcs=[target_token_fraction], args=args(tmp_path / "c", **common),
                            train_dataset=prompts(tmp_path / "c"),
                            processing_class=AutoTokenizer.from_pretrained(qwen2_model))
    by_object.train()
    expected = read_metrics(tmp_path / "a" / "out")
    for trainer in (by_name, by_object):
        got = read_metrics(trainer.cfg.output_dir)
        for name in ("reward", "kl", "loss", "entropy", "grad_norm"):  # the object's reference: a copy of it
            assert [r[name] for r in got] == [r[name] for r in expected], name
        assert abs(got[0]["kl"]) < 1e-6
        final = weights(trainer)
        assert all(torch.equal(final[k], v) for k, v in weights(by_config).items())
    assert by_name.state.global_step == 4 and [h["step"] for h in by_name.state.log_history] == [1, 2, 3, 4]


def test_lora_reward_model_objects_and_async_functions_mix(tmp_path, qwen2_model, reward_model):
    from peft import LoraConfig

    scorer = AutoModelForSequenceClassification.from_pretrained(reward_model)
    trainer = RLOOTrainer(
        model=str(qwen2_model),
        reward_funcs=[target_token_fraction, async_length_reward, scorer],
        reward_processing_classes=[None, None, AutoTokenizer.from_pretrained(reward_model)],
        args=args(tmp_path, beta=0.05, max_steps=2, reward_weights=[1.0, 0.5, 0.1]),
        train_dataset=prompts(tmp_path), peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]),
    )
    result = trainer.train()
    rows = read_metrics(trainer.cfg.output_dir)
    names = {k.split("/")[1] for k in rows[0] if k.startswith("rewards/") and k.endswith("/mean")}
    assert names == {"target_token_fraction", "async_length_reward", reward_model.name}  # TRL's names
    assert abs(rows[0]["kl"]) < 1e-6  # the adapter-disabled base is the reference
    assert (result.final_dir / "adapter_config.json").is_file()  # a LoRA run saves its adapter, as TRL
    assert trainer.cfg.use_peft and trainer.cfg.lora_r == 4 and trainer.cfg.lora_target_modules == ["q_proj"]


class Recorder(TrainerCallback):
    def __init__(self, stop_at=None, save_at=None):
        self.events, self.stop_at, self.save_at = [], stop_at, save_at

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))
        control.should_training_stop = state.global_step == self.stop_at
        control.should_save = state.global_step == self.save_at

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, "reward" in logs))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step))


def test_callbacks_see_every_step_and_can_save_and_stop_the_run(tmp_path, qwen2_model):
    recorder = Recorder(stop_at=3, save_at=1)
    trainer = RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction, args=args(tmp_path),
                          train_dataset=prompts(tmp_path), callbacks=[recorder])
    result = trainer.train()
    assert result.global_step == 3 and (result.final_dir / "model.safetensors").is_file()
    assert (tmp_path / "out" / "checkpoint-1").is_dir()  # asked for by the callback (save_steps is 0)
    assert recorder.events == [("train_begin", 0), ("step_end", 1), ("log", 1, True), ("save", 1),
                               ("step_end", 2), ("log", 2, True), ("step_end", 3), ("log", 3, True),
                               ("train_end", 3)]


def test_train_resume_from_checkpoint_true_continues_exactly(tmp_path, qwen2_model, monkeypatch):
    def trainer(root):
        return RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction,
                           args=args(root, save_steps=2), train_dataset=prompts(root))

    straight = trainer(tmp_path / "straight")
    straight.train()
    monkeypatch.setenv(CRASH_ENV, "3")
    with pytest.raises(SystemExit):
        trainer(tmp_path / "crashed").train()
    monkeypatch.delenv(CRASH_ENV)
    # A fresh start would overwrite the crashed run: refused when train() starts, not when it is constructed.
    with pytest.raises(ConfigError, match="holds another run's outputs"):
        trainer(tmp_path / "crashed").train()
    resumed = trainer(tmp_path / "crashed")
    resumed.train(resume_from_checkpoint=True)
    assert all(torch.equal(v, weights(straight)[k]) for k, v in weights(resumed).items())
    assert [h["step"] for h in resumed.state.log_history] == [1, 2, 3, 4]  # steps 1-2 from the checkpoint
    for name in ("reward", "loss", "grad_norm"):
        assert [r[name] for r in read_metrics(tmp_path / "crashed" / "out")] == [
            r[name] for r in read_metrics(tmp_path / "straight" / "out")]
    saved = resumed.save_model(str(tmp_path / "saved"))
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer_config.json").is_file()


def test_a_resume_with_other_objects_is_refused(tmp_path, qwen2_model):
    RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction, args=args(tmp_path, save_steps=2),
                train_dataset=prompts(tmp_path)).train()
    other = RLOOTrainer(model=str(qwen2_model), reward_funcs=async_length_reward, args=args(tmp_path, save_steps=2),
                        train_dataset=prompts(tmp_path))
    with pytest.raises(ConfigError, match="reward_funcs \\(given to RLOOTrainer\\)"):
        other.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_an_iterable_dataset_streams_needs_max_steps_and_resumes_exactly(tmp_path, qwen2_model, monkeypatch):
    rows = [json.loads(line) for line in prompt_file(tmp_path).read_text().splitlines()]
    stream = datasets.Dataset.from_list(rows).to_iterable_dataset()
    with pytest.raises(ConfigError, match="train_dataset: an IterableDataset has no length.*set max_steps"):
        RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction, args=args(tmp_path, max_steps=-1),
                    train_dataset=stream)

    def trainer(root):  # 6 steps of 2 prompts: 12 of the 32 rows, in stream order
        return RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction,
                           args=args(root, max_steps=6, save_steps=2), train_dataset=stream)

    straight = trainer(tmp_path / "straight")
    straight.train()
    assert straight.sampler.state_dict()["position"] == 12
    monkeypatch.setenv(CRASH_ENV, "3")
    with pytest.raises(SystemExit):
        trainer(tmp_path / "crashed").train()
    monkeypatch.delenv(CRASH_ENV)
    resumed = trainer(tmp_path / "crashed")
    resumed.train(resume_from_checkpoint=True)
    assert all(torch.equal(v, weights(straight)[k]) for k, v in weights(resumed).items())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"reward_funcs": [42]}, r"reward_funcs\[0\]: a int; expected a 'module:function' path"),
    ({"train_dataset": "dataset-dict"}, r"train_dataset: a DatasetDict of splits \['test', 'train'\]; pass one split"),
    ({"args": {"learning_rate": 1e-5}}, "args: a dict; expected rloo_engine.RLOOConfig"),
    ({"reward_funcs": None}, "neither is set; give a reward model or at least one reward function"),
    ({"reward_processing_classes": [None, None]}, r"reward_processing_classes: 2 given for 1 reward_funcs"),
    ({"model": 3}, "model: a int; expected a model id or directory, a PreTrainedModel or a PeftModel"),
])
def test_arguments_the_engine_cannot_take_are_named_before_anything_loads(tmp_path, qwen2_model, kwargs, message):
    ds = prompts(tmp_path)
    given = dict(model=str(qwen2_model), reward_funcs=target_token_fraction, args=args(tmp_path), train_dataset=ds)
    given.update(kwargs)
    if given["train_dataset"] == "dataset-dict":
        given["train_dataset"] = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(ConfigError, match=message):
        RLOOTrainer(**given)


@pytest.mark.slow
@pytest.mark.parametrize("profile", [None, "deepspeed_zero3"])
def test_the_python_api_under_accelerate_launch_with_two_processes_resumes_exactly(tmp_path, qwen2_model, profile):
    """Each process runs the script and builds its own objects (nothing is pickled across); a crash after step 3
    and `train(resume_from_checkpoint=True)` end where the straight 2-process run ends (DDP, and DeepSpeed ZeRO-3
    from accelerate's profile)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tests.engine.helpers import REPO, repo_pythonpath

    data = prompt_file(tmp_path)
    launcher = (["--config_file", str(REPO / "deployments/accelerate" / f"{profile}.yaml")] if profile else
                ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"])
    launch = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "2",
              "--main_process_port", "0", str(REPO / "tests/engine/scripts/api_train_and_digest.py")]
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    env.pop("MLFLOW_TRACKING_URI", None)

    def run(out, *extra, crash=None):
        return subprocess.run(launch + [str(out), str(qwen2_model), str(data), *extra], capture_output=True,
                              text=True, timeout=600, cwd=REPO, env={**env, **({CRASH_ENV: crash} if crash else {})})

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-4000:]
    assert run(tmp_path / "crashed", crash="3").returncode != 0
    resumed = run(tmp_path / "crashed", "resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    for rank in (0, 1):
        a = json.loads((tmp_path / "straight" / f"digest-rank{rank}.json").read_text())
        b = json.loads((tmp_path / "crashed" / f"digest-rank{rank}.json").read_text())
        assert a["num_processes"] == 2 and a["step"] == b["step"] == 4
        assert a["digest"] == b["digest"]  # this rank's parameters (its shards under ZeRO-3)
        assert b["callback_steps"] == 2  # the resumed process ran steps 3 and 4 (from checkpoint-2)
        assert a["log_history_steps"] == b["log_history_steps"] == [1, 2, 2, 3, 4, 4]  # train rows + eval rows
    final = [load_file(str(tmp_path / run_dir / "final" / "model.safetensors")) for run_dir in ("straight", "crashed")]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    assert [r["step"] for r in read_metrics(tmp_path / "crashed") if "eval_reward" in r] == [2, 4]


def test_another_run_into_the_output_dir_of_a_live_trainer_is_refused(tmp_path, qwen2_model):
    """The lock is taken when the trainer is built (as TRL loads its models then) and held until train() ends."""
    import subprocess
    import sys

    from tests.engine.helpers import REPO, repo_pythonpath

    live = RLOOTrainer(model=str(qwen2_model), reward_funcs=target_token_fraction, args=args(tmp_path),
                       train_dataset=prompts(tmp_path))
    other = subprocess.run([sys.executable, "-m", "rloo_engine", "train", "--model_name_or_path", str(qwen2_model),
                            "--dataset_name", str(prompt_file(tmp_path)), "--reward_funcs",
                            "tests.engine.helpers:target_token_fraction", "--output_dir", live.cfg.output_dir],
                           capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={"PATH": "/usr/bin:/bin", "PYTHONPATH": repo_pythonpath(), "HOME": str(tmp_path)})
    assert other.returncode == 2 and "is in use by another run" in other.stderr, other.stderr[-2000:]
    live.train()
    assert (tmp_path / "out" / "final").is_dir()

def test_the_seed_example_needs_no_args_and_writes_where_trl_writes(tmp_path, qwen2_model, monkeypatch, capsys):
    """`RLOOTrainer(model=..., reward_funcs=..., train_dataset=...)` alone: TRL's default output_dir
    (`<model name>-RLOO`) and TRL's defaults (3 epochs, G=2: 32 prompts * 3 / 4 prompts a step = 24 steps)."""
    monkeypatch.chdir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    model.config.max_position_embeddings = 1024  # room for TRL's 512 completion tokens (rotary: no table to grow)
    trainer = RLOOTrainer(model=model, reward_funcs=target_token_fraction, train_dataset=prompts(tmp_path))
    assert trainer.cfg.output_dir == "qwen2-RLOO"
    assert trainer.total_steps == 24 and trainer.cfg.num_generations == 2
    said = capsys.readouterr().err  # the defaults kept different from TRL's, said once as the command line says them
    assert "rloo-engine: bf16: false here (TRL: true) because" in said
    assert "rloo-engine: gradient_checkpointing: false here (TRL: true)" in said
    RLOOTrainer(model=model, reward_funcs=target_token_fraction, train_dataset=prompts(tmp_path),
                args=RLOOConfig(output_dir="explicit", bf16=False, gradient_checkpointing=False))
    assert "here (TRL: true)" not in capsys.readouterr().err  # set by the user: nothing to say


def readme_python_example() -> str:
    """The README block whose doc-test marker names this file (`covered tests/engine/test_python_api.py:...`)."""
    from tests.doc_blocks import REPO, blocks

    (block,) = [b for b in blocks(REPO / "README.md")
                if b.kind == "covered" and "tests/engine/test_python_api.py:python-api-example" in b.argument]
    return block.text


def test_the_readme_python_example_runs(tmp_path, qwen2_model, monkeypatch):
    """README's block as written, with the hub id swapped for a local tiny model (no downloads) and fewer steps."""
    code = readme_python_example()
    assert '"Qwen/Qwen2-0.5B-Instruct"' in code and "max_steps=200, save_steps=50" in code
    code = code.replace('"Qwen/Qwen2-0.5B-Instruct"', repr(str(qwen2_model)))
    code = code.replace("max_steps=200, save_steps=50", "max_steps=4, save_steps=2, per_device_train_batch_size=8, "
                        "max_completion_length=8").replace("eval_steps=50", "eval_steps=2")
    monkeypatch.chdir(tmp_path)
    rows = [json.loads(line) for line in prompt_file(tmp_path).read_text().splitlines()]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({**r, "ground_truth": r["topic"]}) + "\n" for r in rows))
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = tmp_path / "Qwen2-0.5B-RLOO"
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoint-2").is_dir()
    assert [r["step"] for r in read_metrics(out) if "eval_reward" in r] == [2, 4]
    assert any("rewards/accuracy_reward/mean" in r for r in read_metrics(out))  # the last step is always logged
