"""A fresh run never overwrites another run's outputs, and a resume continues only the run it was saved by
(issue 22, defects 8 and 9): both refused before any model loads, with the way on named."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import read_metrics, tiny_config


def digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".rloo-engine.lock"}


@pytest.fixture
def finished_run(tmp_path, qwen2_model):
    """A finished 4-step run with checkpoint-2, final/ and 4 metrics rows in tmp_path/out."""
    cfg = tiny_config(tmp_path, qwen2_model, save_steps=2, max_steps=4)
    RLOOTrainer(cfg).train()
    out = Path(cfg.output_dir)
    assert (out / "checkpoint-2").is_dir() and (out / "final").is_dir() and len(read_metrics(out)) == 4
    return cfg


def test_a_fresh_run_into_a_finished_run_is_refused_and_touches_nothing(tmp_path, qwen2_model, finished_run):
    out = Path(finished_run.output_dir)
    before = digest_tree(out)
    second = tiny_config(tmp_path, qwen2_model, max_steps=3, learning_rate=5e-4)
    with pytest.raises(ConfigError) as err:
        RLOOTrainer(second)
    message = str(err.value)
    assert f"output_dir: {out} holds another run's outputs (checkpoint-2, final/, metrics.jsonl" in message
    assert "--resume_from_checkpoint latest" in message and "--overwrite_output_dir true" in message
    assert digest_tree(out) == before  # byte-identical: nothing was touched


def test_overwrite_output_dir_starts_clean(tmp_path, qwen2_model, finished_run):
    out = Path(finished_run.output_dir)
    RLOOTrainer(tiny_config(tmp_path, qwen2_model, max_steps=3, overwrite_output_dir=True)).train()
    assert not list(out.glob("checkpoint-*"))  # the old run's checkpoint-2 is gone; this run saved none
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"learning_rate": 3e-3}, "learning_rate: 0.001 -> 0.003"),
        ({"lr_scheduler_type": "cosine"}, "lr_scheduler_type: 'linear' -> 'cosine'"),
        ({"per_device_train_batch_size": 4}, "per_device_train_batch_size: 8 -> 4"),
    ],
)
def test_a_resume_with_another_trajectory_is_refused_with_the_fields_named(
    tmp_path, qwen2_model, finished_run, change, named
):
    out = Path(finished_run.output_dir)
    before = digest_tree(out)
    with pytest.raises(ConfigError, match="resume_from_checkpoint: .*checkpoint-2 was saved by a run with other options") as err:
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, save_steps=2, resume_from_checkpoint="latest", **change))
    assert named in str(err.value) and "max_steps" in str(err.value)  # and what may change
    assert digest_tree(out) == before


def test_a_resume_with_a_longer_max_steps_continues(tmp_path, qwen2_model, finished_run, capsys):
    cfg = tiny_config(tmp_path, qwen2_model, save_steps=2, max_steps=6, logging_steps=2,
                      resume_from_checkpoint="latest")
    RLOOTrainer(cfg).train()
    assert "resumed from" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(Path(cfg.output_dir))] == [1, 2, 4, 6]


def test_overwrite_and_resume_together_are_a_config_error(tmp_path, qwen2_model):
    with pytest.raises(ConfigError, match="overwrite_output_dir: true with resume_from_checkpoint: 'latest'"):
        tiny_config(tmp_path, qwen2_model, overwrite_output_dir=True, resume_from_checkpoint="latest")


def test_trls_overwrite_output_dir_flag_now_does_what_it_says():
    from rloo_engine.cli import parse_train_args

    cfg = parse_train_args(["--model_name_or_path", "org/m", "--dataset_name", "d.jsonl", "--reward_funcs", "a:b",
                            "--overwrite_output_dir", "true"])
    assert cfg.overwrite_output_dir is True


def test_a_moved_dataset_resumes_and_other_data_is_refused(tmp_path, qwen2_model, finished_run):
    import shutil

    moved = tmp_path / "moved" / "prompts.jsonl"
    moved.parent.mkdir()
    shutil.copy(finished_run.dataset_name, moved)  # the same prompts under another path: a copied run directory
    RLOOTrainer(tiny_config(tmp_path, qwen2_model, save_steps=2, max_steps=5, dataset_name=str(moved),
                            resume_from_checkpoint="latest")).train()
    other = tmp_path / "other.jsonl"
    other.write_text(Path(finished_run.dataset_name).read_text().replace("cat", "cow"))
    with pytest.raises(ConfigError, match=r"dataset_name: .* -> .*other.jsonl' \(other content\)"):
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, save_steps=2, max_steps=6, dataset_name=str(other),
                                resume_from_checkpoint="latest"))


def test_a_killed_attempt_of_the_same_run_may_start_over(tmp_path, qwen2_model):
    # No checkpoint and no final/: only the history of this same configuration, which a restart cuts back.
    cfg = tiny_config(tmp_path, qwen2_model, max_steps=2)
    out = Path(cfg.output_dir)
    RLOOTrainer(cfg).train()
    import shutil

    shutil.rmtree(out / "final")  # as if it had been killed after logging, before the end
    RLOOTrainer(cfg).train()
    assert [r["step"] for r in read_metrics(out)] == [1, 2]
    with pytest.raises(ConfigError, match="holds another run's outputs"):  # another configuration may not
        shutil.rmtree(out / "final")
        RLOOTrainer(tiny_config(tmp_path, qwen2_model, max_steps=2, learning_rate=2e-3))
