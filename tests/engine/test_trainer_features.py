"""Pluggable generation backends, gradient checkpointing, the LR schedule and MLflow logging."""

from __future__ import annotations

import os

import mlflow
import pytest
import torch

from rloo_engine.generation.base import Rollout
from rloo_engine.generation.hf import HFGenerationBackend
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config


class RecordingBackend:
    """Stands in for a vLLM backend: samples through the HF backend, records weight syncs."""

    def __init__(self, inner: HFGenerationBackend):
        self.inner, self.synced_at, self.calls = inner, [], 0

    def generate(self, prompts, num_generations, add_special_tokens=False) -> Rollout:
        self.calls += 1
        return self.inner.generate(prompts, num_generations, add_special_tokens)

    def sync_weights(self, model, step=0) -> None:
        self.synced_at.append((self.calls, step))
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_generation_backend_is_pluggable_and_synced_before_each_generation(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=3, learning_rate=1e-2)
    trainer = RLOOTrainer(cfg)
    backend = RecordingBackend(trainer.backend)
    trainer.backend = backend
    trainer.train()
    assert backend.calls == 3
    assert backend.synced_at == [(0, 0), (1, 1), (2, 2)]  # fresh weights before every generation, with their step
    final = trainer.acc.unwrap_model(trainer.policy).state_dict()
    assert any(not torch.equal(final[k], v) for k, v in backend.weights.items())  # last sync predates last step


def test_shared_prefill_samples_exactly_what_num_return_sequences_samples(qwen2_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo_engine.generation.base import SamplingParams

    model, tok = AutoModelForCausalLM.from_pretrained(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model)
    prompts = ["the cat sat on the mat and", "a big red fox", "why"]
    outs = []
    for shared in (True, False):
        torch.manual_seed(0)
        backend = HFGenerationBackend(lambda: model, tok, SamplingParams(max_completion_length=8), shared_prefill=shared)
        outs.append(backend.generate(prompts, 4))
    torch.testing.assert_close(outs[0].completion_ids, outs[1].completion_ids)
    assert outs[0].completion_ids.shape[0] == 12
    # groups are contiguous: rows [4k, 4k+4) share prompt k
    assert torch.equal(outs[0].prompt_ids[0], outs[0].prompt_ids[3]) and not torch.equal(outs[0].prompt_ids[3], outs[0].prompt_ids[4])


def test_gradient_checkpointing_gives_the_same_updates(tmp_path, qwen2_model):
    losses = []
    for gc in (False, True):
        cfg = tiny_config(tmp_path / str(gc), qwen2_model, gradient_checkpointing=gc, max_steps=2, beta=0.05)
        RLOOTrainer(cfg).train()
        losses.append([(r["grad_norm"], r["kl"], r["entropy"]) for r in read_metrics(cfg.output_dir)])
    for plain, checkpointed in zip(*losses):
        assert plain == pytest.approx(checkpointed, rel=1e-4, abs=1e-7)


def test_lr_schedule_warmup_then_linear_decay(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=6, warmup_steps=2, learning_rate=1e-3)
    RLOOTrainer(cfg).train()
    lrs = [r["learning_rate"] for r in read_metrics(cfg.output_dir)]
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4])


def test_metrics_go_to_the_mlflow_run_named_in_the_environment(tmp_path, qwen2_model, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("engine-test", artifact_location=str(tmp_path / "artifacts"))
    run = mlflow.MlflowClient(uri).create_run(exp)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=3, log_completions=True)
    RLOOTrainer(cfg).train()
    client = mlflow.MlflowClient(uri)
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [m.step for m in history] == [1, 2, 3]
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # the launcher owns the run's status
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "metrics.jsonl", "completions.json"} <= artifacts
    os.environ.pop("MLFLOW_RUN_ID", None)


def test_every_fast_path_probe_says_why_in_one_format():
    """One rule (`fast_path.fast_path_holds`): a path that cannot run, a probe that raises, and a difference over
    the tolerance each keep the plain path with one line `rloo-engine: <name>: <why>; <fallback>`."""
    from rloo_engine.fast_path import fast_path_holds

    said: list[str] = []
    assert fast_path_holds("p", lambda: 1e-6, 1e-4, "plain", said.append) and said == []
    assert not fast_path_holds("p", lambda: "no cache here", 1e-4, "plain", said.append)
    assert not fast_path_holds("p", lambda: 0.5, 1e-4, "plain", said.append)

    def raising() -> float:
        raise IndexError("index 3 is out of bounds")

    assert not fast_path_holds("p", raising, 1e-4, "plain", said.append)
    assert said == ["rloo-engine: p: no cache here; plain",
                    "rloo-engine: p: on a probe batch it is up to 0.5 away from the plain path (tolerance 0.0001); plain",
                    "rloo-engine: p: its check failed (IndexError: index 3 is out of bounds); plain"]


def test_a_run_without_deepspeed_does_not_import_it_while_training(qwen2_model, tmp_path):
    # accelerate's unwrap_model imports DeepSpeed whenever it is installed (and DeepSpeed imports MLflow): ~50 MiB
    # resident and ~1 s for a run that never uses it. transformers' save_pretrained does the same (its own unwrap),
    # so a run without DeepSpeed imports it at its first checkpoint or the final save, not at start-up.
    import json
    import subprocess
    import sys

    from tests.engine.helpers import repo_pythonpath

    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from rloo_engine.trainer import RLOOTrainer\n"
        "from transformers import TrainerCallback\n"
        "from tests.engine.helpers import tiny_config\n"
        "class Watch(TrainerCallback):\n"
        "    seen = []\n"
        "    def on_step_end(self, args, state, control, **kw):\n"
        "        Watch.seen.append('deepspeed' in sys.modules)\n"
        f"cfg = tiny_config(Path({str(tmp_path)!r}), Path({str(qwen2_model)!r}), max_steps=2, beta=0.05)\n"
        "RLOOTrainer(cfg, callbacks=[Watch()]).train()\n"
        "print(json.dumps(Watch.seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert out.returncode == 0, out.stderr[-3000:]
    import importlib.util

    assert importlib.util.find_spec("deepspeed") is not None  # installed: the case this guards
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, False]  # after each of the two steps
