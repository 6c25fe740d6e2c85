"""Whether a run may start or continue in its output_dir: a fresh run never overwrites another run's outputs
unless told to (`overwrite_output_dir`), and a resume continues only the run it was saved by, with the same
trajectory (optimizer, schedule, batch shape, model, reward, sampling). Checked before any model loads, reading
only small files, so nothing of the old run is touched before the user has chosen."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError

# Options a resume may change: they say how long to train and how to report it, not what training does.
RESUMABLE_CHANGES = frozenset({
    "max_steps", "num_train_epochs", "logging_steps", "save_steps", "save_total_limit", "log_completions",
    "num_completions_to_print", "disable_tqdm", "output_dir", "run_name", "resume_from_checkpoint",
    "overwrite_output_dir", "reward_source_max_empty_steps", "attn_implementation",
})
CONFIG_FILE = "config.yaml"  # the config of the run that last started in output_dir
OUTPUT_FILES = ("metrics.jsonl", "completions.jsonl")


def previous_outputs(out: Path) -> list[str]:
    """What an earlier run left in `out`: its checkpoints, `final/` and non-empty history files."""
    if not out.is_dir():
        return []
    found = sorted((p.name for p in out.glob("checkpoint-*") if p.is_dir()), key=lambda n: int(n.split("-")[1])
                   if n.split("-")[1].isdigit() else -1)
    if (out / "final").is_dir():
        found.append("final/")
    found += [name for name in OUTPUT_FILES if (out / name).is_file() and (out / name).stat().st_size > 0]
    return found


def trajectory_differences(saved: dict[str, Any], cfg: RLOOConfig) -> list[str]:
    """`field: saved -> now` for every option outside RESUMABLE_CHANGES whose value differs."""
    now = cfg.model_dump(mode="json")
    return [
        f"{name}: {saved.get(name)!r} -> {value!r}"
        for name, value in now.items()
        if name not in RESUMABLE_CHANGES and name in saved and saved[name] != value
    ]


def check_start(cfg: RLOOConfig, resume_path: Path | None, report: bool = True) -> None:
    """Raises ConfigError when this run would overwrite or mix with another run in `cfg.output_dir`."""
    out = Path(cfg.output_dir)
    if resume_path is not None:
        saved = json.loads((resume_path / "trainer_state.json").read_text()).get("config")
        if saved is None:  # saved before checkpoints carried their config: nothing to compare with
            if report:
                print(f"rloo-engine: {resume_path} holds no config snapshot; cannot check that this run's options "
                      "match the ones it was saved with", file=sys.stderr)
            return
        if differences := trajectory_differences(saved, cfg):
            raise ConfigError(
                f"resume_from_checkpoint: {resume_path} was saved by a run with other options ("
                + "; ".join(differences)
                + f"). Resume with the options it was saved with, or train into another output_dir. Only "
                f"{', '.join(sorted(RESUMABLE_CHANGES - {'output_dir', 'resume_from_checkpoint'}))} may change"
            )
        return
    found = previous_outputs(out)
    if not found or cfg.overwrite_output_dir:
        return
    if cfg.resume_from_checkpoint == "latest" and "final/" not in found and _same_run_started_here(cfg, out):
        return  # this run's own attempt, killed before its first checkpoint: it starts over
    raise ConfigError(
        f"output_dir: {out} holds another run's outputs ({', '.join(found)}); a fresh run would overwrite them. "
        "Continue that run with --resume_from_checkpoint latest, or pass --overwrite_output_dir true to delete "
        "them first, or choose another output_dir. Nothing was changed"
    )


def _same_run_started_here(cfg: RLOOConfig, out: Path) -> bool:
    path = out / CONFIG_FILE
    if not path.is_file():
        return False
    saved = yaml.safe_load(path.read_text()) or {}
    return not trajectory_differences(saved, cfg)


def clear_previous_outputs(out: Path) -> list[str]:
    """Deletes what `previous_outputs` names (the user asked: `overwrite_output_dir`); returns the names."""
    found = previous_outputs(out)
    for name in found:
        path = out / name.rstrip("/")
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return found
