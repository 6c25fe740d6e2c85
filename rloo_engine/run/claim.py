"""`claim_output_dir`: the start of every run, before any model loads, in the one order that is safe."""

from __future__ import annotations

import sys
from pathlib import Path

from accelerate import Accelerator

from rloo_engine.config import RLOOConfig
from rloo_engine.run import checkpoint as ckpt
from rloo_engine.run.continuity import check_start, clear_previous_outputs
from rloo_engine.run.lock import RunLock, acquire_run_lock
from rloo_engine.run.preflight import check_before_loading
from rloo_engine.run.shared_output_dir import check_output_dir_shared


def claim_output_dir(cfg: RLOOConfig, acc: Accelerator, objects: dict | None = None,
                     resume: str | None = None, decide_start: bool = True) -> tuple[RunLock | None, Path | None]:
    """Checks the config's cheap inputs, takes the directory's lock (rank 0), checks that every node sees one
    filesystem, then (`decide_start`) decides where the run starts (`start_point`). Returns (the lock, or None off
    rank 0; the resume path). `RLOOTrainer(model=...)` decides the start later, in `train(resume_from_checkpoint)`."""
    given = objects or {}  # what RLOOTrainer was given as objects is not looked for on disk
    check_before_loading(cfg, bool(given.get("model")), bool(given.get("processing_class")))  # before the lock
    lock = acquire_run_lock(cfg.output_dir) if acc.is_main_process else None
    try:
        check_output_dir_shared(acc, cfg.output_dir)  # checkpoints need one filesystem across nodes
        return lock, start_point(cfg, acc, objects, resume) if decide_start else None
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def start_point(cfg: RLOOConfig, acc: Accelerator, objects: dict | None = None, resume: str | None = None) -> Path | None:
    """Resolves the checkpoint to resume from (`resume`, else the config's), refuses to overwrite or mix another
    run, and clears the previous outputs when `overwrite_output_dir` says so (`objects`: what RLOOTrainer was given
    as objects, as `config_snapshot` records them)."""
    resume = resume or cfg.resume_from_checkpoint
    resume_path = ckpt.resolve_resume(resume, cfg.output_dir, acc.num_processes, ckpt.state_layout(acc),
                                      report=acc.is_main_process)
    check_start(cfg, resume_path, acc.is_main_process, objects, resume)  # never overwrite or mix another run
    if cfg.overwrite_output_dir and acc.is_main_process:
        if removed := clear_previous_outputs(Path(cfg.output_dir)):
            print(f"rloo-engine: overwrite_output_dir: removed {', '.join(removed)} from {cfg.output_dir}",
                  file=sys.stderr)
    return resume_path
