"""Reward functions get TRL's keyword arguments: TRL's documented examples 1-6 (tests/engine/trl_doc_examples/) train
the engine unchanged, and `trainer_state`, `log_extra`, `log_metric` behave as in TRL 1.16.

A scripted backend writes known completions (the tiny model writes noise), so each reward is known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import torch
from transformers import AutoTokenizer, TrainerState

from rloo_engine.generation.base import Rollout
from rloo_engine.reward_context import RewardLogError, RewardLogs
from rloo_engine.reward_sources import RewardSourceSilent
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import prompt_file, read_metrics, tiny_config

HERE = "tests.engine.test_reward_function_kwargs"
EXAMPLES = "tests.engine.trl_doc_examples"
BOXED = [r" The solution is \boxed{2}.", " I do not know."]  # right for ground truth "2", then unanswered


class ScriptedBackend:
    """Completions from `texts`, in turn (row i of every batch gets texts[i % len(texts)]), each ending in EOS."""

    def __init__(self, model: Path, texts: list[str]):
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.texts = texts

    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False) -> Rollout:
        enc = self.tokenizer(prompts, add_special_tokens=add_special_tokens, padding=True, padding_side="left",
                             return_tensors="pt")
        n = len(prompts) * num_generations
        rows = [self.tokenizer(self.texts[i % len(self.texts)], add_special_tokens=False)["input_ids"]
                + [self.tokenizer.eos_token_id] for i in range(n)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [self.tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        return Rollout(enc["input_ids"].repeat_interleave(num_generations, 0),
                       enc["attention_mask"].repeat_interleave(num_generations, 0), ids, mask,
                       torch.ones(n, dtype=torch.bool))

    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        pass


def train(tmp_path: Path, model: Path, texts: list[str], **overrides) -> Path:
    values = dict(max_steps=2, max_completion_length=32, num_generations=2, per_device_train_batch_size=4,
                  log_completions=True)
    cfg = tiny_config(tmp_path, model, **{**values, **overrides})
    RLOOTrainer(cfg, backend=ScriptedBackend(model, texts)).train()
    return Path(cfg.output_dir)


def write_rows(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def completions(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines() if line]


# ---------------------------------------------------------------- TRL's examples 1-6


def test_example_1_rewards_the_token_count_and_1_1_the_character_count(tmp_path, qwen2_model):
    texts = ["the cat", "the cat sat on the mat"]
    tokenizer = AutoTokenizer.from_pretrained(qwen2_model)
    tokens = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # EOS counts, as TRL's
    for example, per_text in (("example1", tokens), ("example1_1", [len(t) for t in texts])):
        out = train(tmp_path / example, qwen2_model, texts, reward_funcs=[f"{EXAMPLES}.{example}:reward_func"])
        for row in read_metrics(out):  # TRL's name: the function's own name
            assert row["rewards/reward_func/mean"] == pytest.approx(sum(per_text) / 2)
        assert {r["completion"]: r["reward"] for r in completions(out)} == dict(zip(texts, map(float, per_text)))


def test_example_2_format_reward_reads_message_completions_of_chat_prompts(tmp_path, qwen2_model):
    texts = ["<think>3 times 4</think><answer>12</answer>", "12"]
    out = train(tmp_path, qwen2_model, texts, dataset_name=str(prompt_file(tmp_path, conversational=True)),
                reward_funcs=[f"{EXAMPLES}.example2:format_reward_func"])
    assert [r["rewards/format_reward_func/mean"] for r in read_metrics(out)] == [0.5, 0.5]
    assert {(r["completion"], r["reward"]) for r in completions(out)} == {(texts[0], 1.0), (texts[1], 0.0)}
    assert all(r["advantage"] != 0 for r in completions(out))  # one right, one wrong in every group


def test_example_3_accuracy_against_a_ground_truth_column(tmp_path, qwen2_model):
    rows = [{"prompt": f"Problem {i}: Solve $x + {i} = {i + 2}$.", "ground_truth": "2"} for i in range(8)]
    out = train(tmp_path, qwen2_model, BOXED, dataset_name=write_rows(tmp_path, rows),
                reward_funcs=[f"{EXAMPLES}.example3:reward_func"])
    assert [r["rewards/reward_func/mean"] for r in read_metrics(out)] == [0.5, 0.5]
    assert {(r["completion"], r["reward"]) for r in completions(out)} == {(BOXED[0], 1.0), (BOXED[1], 0.0)}


def _multi_task(tmp_path: Path, model: Path, **overrides) -> Path:
    from tests.engine.trl_doc_examples.example4 import dataset

    path = tmp_path / "tasks.jsonl"
    dataset.to_json(str(path))
    # 4 prompts x 2 completions: each step sees every prompt once, both tasks.
    return train(tmp_path, model, ["4", "12"], dataset_name=str(path), per_device_train_batch_size=8,
                 reward_funcs=[f"{EXAMPLES}.example4:math_reward_func", f"{EXAMPLES}.example4:coding_reward_func"],
                 **overrides)


def test_example_4_multi_task_nones_leave_rows_to_the_function_that_judges_them(tmp_path, qwen2_model):
    # As TRL: a None drops that function from the row; a row no function scores is unscorable (reward 0, no
    # advantage). The docs' coding function checks task "coding" where the dataset says "code", so it never
    # scores: TRL trains on, logging its mean as None. With `reward_source_max_empty_steps` 0 the engine does too.
    out = _multi_task(tmp_path, qwen2_model, reward_source_max_empty_steps=0)
    for row in read_metrics(out):
        assert row["rewards/math_reward_func/mean"] == 0.0  # each math prompt: one right (+1), one wrong (-1)
        assert "rewards/coding_reward_func/mean" not in row  # NaN, which TRL logs as None
        assert row["frac_unscorable"] == 0.5
    for r in completions(out):
        if r["prompt"].startswith("What is"):
            right = r["completion"] == {"What is 2+2?": "4", "What is 3*4?": "12"}[r["prompt"]]
            assert r["reward"] == (1.0 if right else -1.0) and r["advantage"] == (2.0 if right else -2.0)
        else:
            assert r["reward"] == 0.0 and r["advantage"] == 0.0


def test_example_4_by_default_a_function_that_never_scores_stops_the_run(tmp_path, qwen2_model):
    with pytest.raises(RewardSourceSilent, match=r"reward_funcs\[1\] .*example4:coding_reward_func scored none"):
        _multi_task(tmp_path, qwen2_model)


def test_example_5_async_reward_function(tmp_path, qwen2_model):
    out = train(tmp_path, qwen2_model, ["the cat", "sat"], reward_funcs=[f"{EXAMPLES}.example5:async_reward_func"])
    assert [r["rewards/async_reward_func/mean"] for r in read_metrics(out)] == [1.0, 1.0]


def test_example_6_log_extra_and_log_metric_reach_metrics_completions_and_mlflow(tmp_path, qwen2_model, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.MlflowClient(uri).create_experiment("kwargs", artifact_location=str(tmp_path / "artifacts"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "kwargs")
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    rows = [{"prompt": f"Problem {i}: Solve $x + {i} = {i + 2}$.", "ground_truth": "2"} for i in range(8)]
    out = train(tmp_path, qwen2_model, BOXED, dataset_name=write_rows(tmp_path, rows),
                reward_funcs=[f"{EXAMPLES}.example6:reward_func"])

    # log_metric: under its own name, beside `kl` and `entropy`
    metrics = read_metrics(out)
    assert [(r["step"], r["accuracy"]) for r in metrics] == [(1, 0.5), (2, 0.5)]
    assert {"kl", "entropy"} <= set(metrics[0])
    # log_extra: columns of completions.jsonl, one value per completion, sorted between the reward and the
    # advantage (TRL's table: rewards, then the extra columns in sorted order, then the advantage)
    samples = completions(out)
    assert [list(r) for r in samples[:1]] == [["step", "prompt", "completion", "reward", "extracted_answer",
                                               "golden_answer", "advantage"]]
    assert {(r["completion"], r["golden_answer"], r["extracted_answer"]) for r in samples} == {
        (BOXED[0], "2", "2"), (BOXED[1], "2", "[none]")}

    client = mlflow.MlflowClient(uri)
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "accuracy")] == [(1, 0.5), (2, 0.5)]
    table = json.loads(Path(client.download_artifacts(run_id, "completions.json", str(tmp_path))).read_text())
    column = table["columns"].index("extracted_answer")
    assert {"golden_answer", "extracted_answer"} <= set(table["columns"])
    assert sorted({row[column] for row in table["data"]}) == ["2", "[none]"]


# ---------------------------------------------------------------- trainer_state


def report_trainer_state(completions, trainer_state, log_metric, **kwargs):
    """Logs what a curriculum reads from `trainer_state`, and scores every completion 1."""
    assert isinstance(trainer_state, TrainerState)
    log_metric("state/global_step", trainer_state.global_step)
    log_metric("state/max_steps", trainer_state.max_steps)
    log_metric("state/epoch", trainer_state.epoch)
    log_metric("state/log_history", len(trainer_state.log_history))
    log_metric("state/world_process_zero", float(trainer_state.is_world_process_zero))
    return [1.0] * len(completions)


def test_trainer_state_is_transformers_trainer_state_at_the_steps_done(tmp_path, qwen2_model):
    out = train(tmp_path, qwen2_model, ["the cat"], max_steps=3, reward_funcs=[f"{HERE}:report_trainer_state"])
    rows = read_metrics(out)
    # Each batch is scored before its step: global_step is the optimizer steps done so far, as TRL's `self.state`.
    assert [r["state/global_step"] for r in rows] == [0.0, 1.0, 2.0]
    assert [r["state/max_steps"] for r in rows] == [3.0] * 3
    assert [r["state/log_history"] for r in rows] == [0.0, 1.0, 2.0]  # every logged row, as the HF Trainer keeps
    assert [r["state/world_process_zero"] for r in rows] == [1.0] * 3
    assert [r["state/epoch"] for r in rows] == [r["epoch"] for r in rows]  # 2 of 32 prompts a step: 1/16, ...


# ---------------------------------------------------------------- merging over processes


def _other_process(extra_names: list[str], metric_names: list[str], sums: torch.Tensor):
    """gather_object / gather as two processes see them, this one first, the other process's values given."""
    return (lambda mine: mine + [(extra_names, metric_names)],
            lambda mine: torch.cat([mine, sums.to(mine.dtype)]))


def test_metrics_average_over_every_value_of_every_process_and_columns_fill_with_none():
    logs = RewardLogs()
    logs.log_metric("accuracy", 1.0)
    logs.log_metric("accuracy", 0.5)  # two functions logged it here
    logs.log_extra("golden_answer", ["2", "3"])
    # The other process logged accuracy once (0.0) and a metric and column this one did not.
    gather_object, gather = _other_process(["judge_note"], ["accuracy", "latency_s"],
                                           torch.tensor([[0.0, 1.0], [4.0, 2.0]]))
    columns, metrics = logs.merge(2, gather_object, gather)
    assert metrics == {"accuracy": pytest.approx(0.5), "latency_s": 2.0}  # (1 + .5 + 0) / 3, as TRL's sum / count
    assert columns == {"golden_answer": ["2", "3"], "judge_note": [None, None]}
    assert logs.merge(2, lambda mine: mine, lambda t: t) == ({}, {})  # cleared for the next batch


def test_log_extra_errors_name_the_column():
    logs = RewardLogs()
    with pytest.raises(RewardLogError, match="'reward' is one the completions table already has"):
        logs.log_extra("reward", [1.0])
    logs.log_extra("note", ["a"])
    with pytest.raises(RewardLogError, match="'note' got 1 values this generation batch; expected 2"):
        logs.merge(2, lambda mine: mine, lambda t: t)
    with pytest.raises(RewardLogError, match="'accuracy' got a str; expected a float"):
        logs.log_metric("accuracy", "high")
