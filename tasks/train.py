"""Task `train_rloo`: run the RLOO engine under `accelerate launch`, in its own process group, tracked in MLflow.

The engine contract: `accelerate launch --config_file deployments/accelerate/<profile>.yaml -m rloo_engine
train --config <cfg.yaml>`. With MLFLOW_TRACKING_URI + MLFLOW_RUN_ID in its environment the engine logs
its metrics into the `train` stage run, which this task owns (FINISHED / FAILED / KILLED). Exit codes:
0 ok, 2 config error (not retried), 3 injected crash (RLOO_ENGINE_CRASH_AT_STEP), anything else a failure.
A Prefect retry reuses the run's output dir, and the engine's `resume_from_checkpoint: latest` continues
from the newest checkpoint there.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from contextlib import nullcontext
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from rloo_engine.config import ConfigError, save_config
from tasks import tracking
from tasks.checkpoints import CheckpointInfo
from tasks.config import PipelineConfig
from tasks.launcher import LaunchTimeout, ThrottledLineLogger, run_in_process_group
from tasks.profiles import resolve_profile
from tasks.reward import RewardInfo
from tasks.secrets import child_env, secret_env
from tasks.tracking import REPO_ROOT, RunRef

EXIT_OK, EXIT_CONFIG, EXIT_INJECTED_CRASH = 0, 2, 3


class EngineConfigError(ConfigError):
    """The engine rejected its configuration (exit code 2); retrying cannot help."""


class EngineCrashed(RuntimeError):
    """The engine process died (injected crash, OOM kill, NCCL error, a bug); a retry resumes from a checkpoint."""


class TrainResult(BaseModel):
    final_dir: str
    output_dir: str
    global_step: int
    metrics: dict[str, float]  # reward_start, reward_end, kl_end, ... from metrics.jsonl
    reward_curve: str | None
    log_path: str
    mlflow_run_id: str
    attempts: int


def _retry_unless_config_error(task, task_run, state) -> bool:
    return not isinstance(getattr(state, "data", None), ConfigError)


@task(name="train_rloo", cache_policy=NO_CACHE, retry_condition_fn=_retry_unless_config_error)
def train_rloo(
    cfg: PipelineConfig, sft: CheckpointInfo, reward: RewardInfo, run_dir: str, parent: RunRef
) -> TrainResult:
    """Trains the policy; returns the final checkpoint and summary metrics."""
    from rloo_engine.checkpoint import checkpoint_dirs  # imports torch; kept out of flow start-up

    logger = get_run_logger()
    out = Path(run_dir) / "train"
    train_run, attempt = tracking.child_run(parent, "train")
    with tracking.run_status(train_run):
        engine_cfg = cfg.engine_config(
            sft_path=sft.local_path,
            reward_model_path=reward.model.local_path if reward.model else None,
            output_dir=str(out),
            run_name=f"{parent.run_id}-train",
        )
        config_path = save_config(engine_cfg, out / "rloo_config.yaml")
        existing = checkpoint_dirs(out)
        if existing:
            logger.info("attempt %d: resuming from %s", attempt, existing[-1])
            tracking.set_tags(train_run, {"rloo.resumed_from": existing[-1].name})
        if attempt == 1:
            tracking.log_params(train_run, {f"train.{k}": v for k, v in cfg.train.model_dump().items()})
            tracking.log_params(train_run, {f"launch.{k}": v for k, v in cfg.launch.model_dump().items()})

        cmd = launch_command(cfg, config_path)
        env = _training_env(cfg, train_run)
        log_path = out / "train.log"
        logger.info("launching: %s", " ".join(cmd))
        slot = _gpu_slot(cfg.launch.gpu_concurrency_limit)
        try:
            with slot:
                outcome = run_in_process_group(
                    cmd,
                    env=env,
                    cwd=REPO_ROOT,
                    log_path=log_path,
                    on_line=ThrottledLineLogger(logger, cfg.launch.log_interval_seconds),
                    timeout_seconds=cfg.launch.timeout_seconds,
                    kill_grace_seconds=cfg.launch.kill_grace_seconds,
                )
        except LaunchTimeout as err:
            raise TimeoutError(f"launch.timeout_seconds: training {err}; the process group was killed") from None
        finally:
            tracking.log_artifact(train_run, log_path, "logs")
        record_exit(train_run, outcome.returncode, outcome.tail)
        raise_for_exit(outcome.returncode, outcome.tail, log_path)

        final = out / "final"
        metrics_rows = read_jsonl(out / "metrics.jsonl")
        summary = summarize_metrics(metrics_rows)
        curve = plot_reward_curve(metrics_rows, out / "reward_curve.png")
        if curve:
            tracking.log_artifact(train_run, curve)
        tracking.log_metrics(train_run, {f"summary/{k}": v for k, v in summary.items()})
        logger.info(
            "trained %d steps: reward %.4f -> %.4f, kl %.4f",
            summary.get("global_step", 0),
            summary.get("reward_start", float("nan")),
            summary.get("reward_end", float("nan")),
            summary.get("kl_end", float("nan")),
        )
        return TrainResult(
            final_dir=str(final),
            output_dir=str(out),
            global_step=int(summary.get("global_step", 0)),
            metrics=summary,
            reward_curve=str(curve) if curve else None,
            log_path=str(log_path),
            mlflow_run_id=train_run.run_id,
            attempts=attempt,
        )


def launch_command(cfg: PipelineConfig, config_path: Path) -> list[str]:
    """`accelerate launch --config_file <profile> [overrides] -m rloo_engine train --config <file>`."""
    launch = cfg.launch
    profile = resolve_profile(launch.profile, REPO_ROOT, dict(os.environ))
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(profile)]
    if launch.num_processes is not None:
        cmd += ["--num_processes", str(launch.num_processes)]
    if launch.num_machines > 1:
        cmd += ["--num_machines", str(launch.num_machines), "--machine_rank", str(launch.machine_rank)]
        if launch.main_process_ip:
            cmd += ["--main_process_ip", launch.main_process_ip]
    if launch.main_process_port:
        cmd += ["--main_process_port", str(launch.main_process_port)]
    return cmd + ["-m", "rloo_engine", "train", "--config", str(config_path)]


def _training_env(cfg: PipelineConfig, train_run: RunRef) -> dict[str, str]:
    """The worker's environment minus the judge's key, plus launch.env, launch secrets and the MLflow run."""
    withhold = {cfg.evaluation.judge.api_key_env} if cfg.evaluation.judge.api_key_env else set()
    extra = {
        **cfg.launch.env,
        **secret_env(cfg.launch.secret_env, "launch.secret_env"),
        "MLFLOW_TRACKING_URI": train_run.tracking_uri,
        "MLFLOW_RUN_ID": train_run.run_id,
        "PYTHONUNBUFFERED": "1",
        "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "5"),
    }
    return child_env(dict(os.environ), withhold, extra)


def _gpu_slot(limit_name: str | None):
    """Holds one slot of a Prefect global concurrency limit while training, when one is configured."""
    if not limit_name:
        return nullcontext()
    from prefect.concurrency.sync import concurrency

    # strict: a misspelt or missing limit fails here, not silently; a lease hiccup must not kill hours of training.
    return concurrency(
        limit_name.format(hostname=socket.gethostname()), occupy=1, strict=True, raise_on_lease_renewal_failure=False
    )


# How accelerate reports its child's end: CalledProcessError says "returned non-zero exit status 3" or, for a
# signal, "died with <Signals.SIGKILL: 9>"; torchrun's error summary says "exitcode  : -9".
_LAUNCHER_CHILD_EXIT = re.compile(
    r"returned non-zero exit status (-?\d+)|exitcode\s*:\s*(-?\d+)|died with <Signals\.\w+: (\d+)>"
)


def engine_exit_code(returncode: int, tail: list[str]) -> int:
    """The engine's own exit code (negative: killed by that signal); accelerate's launcher exits 1 and reports it."""
    if returncode in (EXIT_OK, EXIT_CONFIG, EXIT_INJECTED_CRASH) or returncode < 0:
        return returncode
    for line in reversed(tail):
        if m := _LAUNCHER_CHILD_EXIT.search(line):
            return -int(m.group(3)) if m.group(3) else int(m.group(1) or m.group(2))
    return returncode


def exit_cause(code: int) -> str:
    """`exit code N`, or `killed by SIGNAME` for a negative code, with the usual reason for a SIGKILL."""
    if code >= 0:
        return f"exit code {code}"
    import signal

    name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
    return f"killed by {name}" + (" (often the OOM killer)" if name == "SIGKILL" else "")


def record_exit(train_run: RunRef, returncode: int, tail: list[str]) -> None:
    """Tags the train run with how the engine ended (`rloo.exit_code`, `rloo.exit_cause`), so a kill shows as one."""
    code = engine_exit_code(returncode, tail)
    tracking.set_tags(train_run, {"rloo.exit_code": code, "rloo.exit_cause": exit_cause(code)})


def raise_for_exit(returncode: int, tail: list[str], log_path: Path) -> None:
    """Maps the engine's exit code to an error that says what happened and where to look."""
    code = engine_exit_code(returncode, tail)
    if code == EXIT_OK:
        return
    last = "\n".join(tail[-15:])
    if code == EXIT_CONFIG:
        errors = [ln for ln in tail if ln.startswith("error:")] or tail[-3:]
        raise EngineConfigError("the engine rejected its configuration (exit code 2):\n" + "\n".join(errors))
    if code == EXIT_INJECTED_CRASH:
        raise EngineCrashed(
            f"the engine exited with code 3: an injected crash (RLOO_ENGINE_CRASH_AT_STEP); see {log_path}"
        )
    if code < 0:
        raise EngineCrashed(f"the engine was {exit_cause(code)}; see {log_path}. Last output:\n{last}")
    raise EngineCrashed(f"the engine failed with exit code {code}; see {log_path}. Last output:\n{last}")


# ---------------------------------------------------------------- metrics and artifacts


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file the engine writes (metrics.jsonl, completions.jsonl); [] when it does not exist."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Reward at the first and last logging steps (and the mean of the first/last quarter), final KL."""
    if not rows:
        return {}
    rewards = [r["reward"] for r in rows if "reward" in r]
    k = max(1, len(rewards) // 4)
    summary = {"global_step": float(rows[-1]["step"]), "logged_steps": float(len(rows))}
    if rewards:
        summary.update(
            reward_start=rewards[0],
            reward_end=rewards[-1],
            reward_first_quarter=sum(rewards[:k]) / k,
            reward_last_quarter=sum(rewards[-k:]) / k,
        )
    for key in ("kl", "completions/mean_length", "loss"):
        values = [r[key] for r in rows if key in r]
        if values:
            summary[f"{key.replace('completions/', '')}_end"] = values[-1]
    return summary


def plot_reward_curve(rows: list[dict[str, float]], path: Path) -> Path | None:
    """reward (with ±reward_std) and KL against step, as a PNG (matplotlib, Agg backend, no display needed)."""
    points = [r for r in rows if "reward" in r]
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in points]
    reward = [r["reward"] for r in points]
    std = [r.get("reward_std", 0.0) for r in points]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, reward, marker="o", label="reward")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(reward, std, strict=True)],
        [m + s for m, s in zip(reward, std, strict=True)],
        alpha=0.2,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if any("kl" in r for r in points):
        kl_ax = ax.twinx()
        kl_ax.plot(steps, [r.get("kl", float("nan")) for r in points], color="tab:red", linestyle="--", label="kl")
        kl_ax.set_ylabel("kl", color="tab:red")
    ax.set_title("RLOO reward curve")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
