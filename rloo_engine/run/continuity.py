"""Whether a run may start or continue in its output_dir: a fresh run never overwrites another run's outputs
unless told to (`overwrite_output_dir`), and a resume continues only the run it was saved by, with the same
trajectory (optimizer, schedule, batch shape, model, reward, sampling). Checked before any model loads, reading
only small files, so nothing of the old run is touched before the user has chosen."""

from __future__ import annotations

import hashlib
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
    # where the vLLM server is, not what it computes: a resume may find it restarted elsewhere
    "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
})
# Options that name a file or directory: a run directory and its data may be moved or copied, so these compare
# by content (`content_fingerprint`) rather than by path.
PATH_OPTIONS = ("model_name_or_path", "reward_model_name_or_path", "dataset_name")
CONFIG_FILE = "config.yaml"  # the config of the run that last started in output_dir
OUTPUT_FILES = ("metrics.jsonl", "completions.jsonl")


def previous_outputs(out: Path) -> list[str]:
    """What an earlier run left in `out`: its checkpoints, `final/` (and `final-merged/`), non-empty history files."""
    if not out.is_dir():
        return []
    found = sorted((p.name for p in out.glob("checkpoint-*") if p.is_dir()), key=lambda n: int(n.split("-")[1])
                   if n.split("-")[1].isdigit() else -1)
    found += [f"{name}/" for name in ("final", "final-merged") if (out / name).is_dir()]
    found += [name for name in OUTPUT_FILES if (out / name).is_file() and (out / name).stat().st_size > 0]
    return found


def content_fingerprint(value: str | None) -> str | None:
    """Names and sizes of the files under a local path (the first bytes of each file too), or None for a hub id:
    cheap, and it tells a copied dataset or model from a different one."""
    if not value or not Path(value).exists():
        return None
    root = Path(value)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.relative_to(root) if f != root else f.name}:{f.stat().st_size}:".encode())
        with f.open("rb") as fh:
            digest.update(fh.read(1 << 16))
    return digest.hexdigest()[:16]


def config_snapshot(cfg: RLOOConfig, objects: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint records of its run: every option, the content fingerprint of each path option, and what
    `RLOOTrainer` was given as objects (`TrainerInputs.describe`: dataset fingerprints, reward function names)."""
    values = cfg.model_dump(mode="json")
    values["_fingerprints"] = {name: content_fingerprint(values.get(name)) for name in PATH_OPTIONS}
    values["_objects"] = objects or {}
    return values


def trajectory_differences(saved: dict[str, Any], cfg: RLOOConfig, objects: dict[str, Any] | None = None) -> list[str]:
    """`field: saved -> now` for every option outside RESUMABLE_CHANGES whose value differs (path options: whose
    content differs, when both were fingerprinted), and for each object given in place of one."""
    now = cfg.model_dump(mode="json")
    fingerprints = saved.get("_fingerprints") or {}
    differences = [f"{name} (given to RLOOTrainer): {before!r} -> {(objects or {}).get(name)!r}"
                   for name, before in (saved.get("_objects") or {}).items()
                   if before != (objects or {}).get(name)]
    for name, value in now.items():
        if name in RESUMABLE_CHANGES or name not in saved or saved[name] == value:
            continue
        if name in PATH_OPTIONS and fingerprints.get(name) is not None:
            if fingerprints[name] == content_fingerprint(value):
                continue  # the same content, moved or copied
            differences.append(f"{name}: {saved[name]!r} -> {value!r} (other content)")
            continue
        differences.append(f"{name}: {saved[name]!r} -> {value!r}")
    return differences


def check_start(cfg: RLOOConfig, resume_path: Path | None, report: bool = True,
                objects: dict[str, Any] | None = None, resume: str | None = None) -> None:
    """Raises ConfigError when this run would overwrite or mix with another run in `cfg.output_dir`. `resume`: what
    was asked for (`latest` that found no usable checkpoint among some is refused, not started over)."""
    out = Path(cfg.output_dir)
    if resume_path is not None:
        saved = json.loads((resume_path / "trainer_state.json").read_text()).get("config")
        if saved is None:  # saved before checkpoints carried their config: nothing to compare with
            if report:
                print(f"rloo-engine: {resume_path} holds no config snapshot; cannot check that this run's options "
                      "match the ones it was saved with", file=sys.stderr)
            return
        if differences := trajectory_differences(saved, cfg, objects):
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
    if resume == "latest" and any(name.startswith("checkpoint-") for name in found):
        raise ConfigError(
            f"resume_from_checkpoint: latest found no usable checkpoint in {out} (each one skipped is named above), "
            "so the run cannot continue. Start it over with --overwrite_output_dir true (which deletes "
            f"{', '.join(found)}), or train into another output_dir. Nothing was changed"
        )
    unfinished = not any(name == "final/" or name.startswith("checkpoint-") for name in found)
    if unfinished and _same_run_started_here(cfg, out):
        return  # this same run's attempt, killed before its first checkpoint: it starts over
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
