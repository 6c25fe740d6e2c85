"""Task `train_rloo`: run the RLOO engine under `accelerate launch`, in its own process group, tracked in MLflow.

The engine contract: `accelerate launch --config_file deployments/accelerate/<profile>.yaml -m rloo_engine
train --config <cfg.yaml>` (`rloo_engine/pipeline/train_launch.py`). With MLFLOW_TRACKING_URI + MLFLOW_RUN_ID in
its environment the engine logs its metrics into the `train` stage run, which this task owns (FINISHED / FAILED /
KILLED). A config error (exit 2) is not retried; a Prefect retry reuses the run's output dir, and the engine's
`resume_from_checkpoint: latest` continues from the newest checkpoint there.

With `launch.vllm_server.enabled` (`train.vllm_mode: server`) the task first starts `rloo-engine vllm-serve` on
the SFT checkpoint, in a process group of its own (`rloo_engine/pipeline/vllm_server.py`), waits for its
`/health`, gives its URL to the engine, and stops it when training ends however it ends; its log is the train
run's `logs/vllm_server.log`.
"""

from __future__ import annotations

import os
import socket
from contextlib import nullcontext
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from rloo_engine.config import save_config
from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline import tracking
from rloo_engine.pipeline.config import PipelineConfig
from rloo_engine.pipeline.environment import child_env
from rloo_engine.pipeline.input_checkpoints import CheckpointInfo
from rloo_engine.pipeline.launcher import LaunchTimeout, ThrottledLineLogger, run_in_process_group
from rloo_engine.pipeline.profiles import resolve_profile
from rloo_engine.pipeline.stage_results import RewardInfo, TrainStageResult
from rloo_engine.pipeline.tracking import RunRef
from rloo_engine.pipeline.train_launch import launch_command, raise_for_exit, record_exit
from rloo_engine.pipeline.train_outputs import plot_reward_curve, read_jsonl, summarize_metrics
from rloo_engine.pipeline.vllm_server import (
    pick_port,
    running_vllm_server,
    serve_command,
    split_devices,
    visible_cuda_devices,
)
from tasks.secrets import secret_env
from tasks.train_nodes import NodeLaunch


def _retry_unless_config_error(task, task_run, state) -> bool:
    return not isinstance(getattr(state, "data", None), ConfigError)


@task(name="train_rloo", cache_policy=NO_CACHE, retry_condition_fn=_retry_unless_config_error)
def train_rloo(
    cfg: PipelineConfig, sft: CheckpointInfo, reward: RewardInfo, run_dir: str, parent: RunRef
) -> TrainStageResult:
    """Trains the policy; returns the final checkpoint and summary metrics."""
    from rloo_engine.mlflow_sender import PENDING_FILE, sync_output_dir
    from rloo_engine.run.checkpoint import checkpoint_dirs  # imports torch; kept out of flow start-up

    logger = get_run_logger()
    out = Path(run_dir) / "train"
    train_run, attempt = tracking.child_run(parent, "train")
    with tracking.run_status(train_run), _node_launch(cfg, out, train_run) as nodes:
        server = cfg.launch.vllm_server
        server_url = None
        if server.enabled and nodes is not None and server.placement == "node":
            server_url = nodes.start_server(sft.local_path)
            logger.info("vLLM server node healthy at %s", server_url)
            tracking.set_tags(train_run, {"rloo.vllm_server_url": server_url})
        elif server.enabled:
            server_url = f"http://{server.host}:{pick_port(server.host, server.port)}"
        engine_cfg = cfg.engine_config(
            sft_path=sft.local_path,
            reward_model_path=reward.model.local_path if reward.model else None,
            output_dir=str(out),
            run_name=f"{parent.run_id}-train",
            vllm_server_url=server_url,
        )
        config_path = save_config(engine_cfg, out / "rloo_config.yaml")
        existing = checkpoint_dirs(out)
        if existing:
            logger.info("attempt %d: resuming from %s", attempt, existing[-1])
            tracking.set_tags(train_run, {"rloo.resumed_from": existing[-1].name})
        if attempt == 1:
            tracking.log_params(train_run, {f"train.{k}": v for k, v in cfg.train.model_dump().items()})
            launch = cfg.launch.model_dump(mode="json")
            sections = {
                **tracking.flat_params(launch.pop("vllm_server"), prefix="launch.vllm_server."),
                **tracking.flat_params(launch.pop("nodes"), prefix="launch.nodes."),
            }
            tracking.log_params(train_run, {**{f"launch.{k}": v for k, v in launch.items()}, **sections})
            tracking.log_params(train_run, {"num_machines": cfg.launch.num_machines, "world_size": _world_size(cfg)})
        if training_finished(out, cfg.train.use_peft):
            # The flow run crashed after training ended (a re-run, or a retry after a later stage failed).
            logger.info("training finished before this attempt (%s is complete); not run again", out / "final")
        elif nodes is not None:
            nodes.train(config_path, server_url, log_params=attempt == 1)
        else:
            _launch_here(cfg, config_path, train_run, sft.local_path, server_url, out)
        if (out / PENDING_FILE).is_file():  # the tracking server failed while the engine trained: send the rest
            sync_output_dir(out, say=logger.warning)
        # A LoRA run's final/ is its adapter; evaluation and the registry take the merged copy beside it.
        final = out / ("final-merged" if cfg.train.use_peft else "final")
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
        return TrainStageResult(
            final_dir=str(final),
            output_dir=str(out),
            global_step=int(summary.get("global_step", 0)),
            metrics=summary,
            reward_curve=str(curve) if curve else None,
            log_path=str(out / ("train.log" if nodes is None else "nodes/node-0.log")),
            mlflow_run_id=train_run.run_id,
            attempts=attempt,
            adapter_dir=str(out / "final") if cfg.train.use_peft else None,
        )


def training_finished(out: Path, use_peft: bool) -> bool:
    """Whether the engine finished in `out`: `final/` (and a LoRA run's `final-merged/`) is renamed into place
    only when complete, and `metrics.jsonl` has reached the run's last step."""
    finals = [out / "final"] + ([out / "final-merged"] if use_peft else [])
    if not all((d / "config.json").is_file() or (d / "adapter_config.json").is_file() for d in finals):
        return False
    rows = read_jsonl(out / "metrics.jsonl")
    config = yaml.safe_load((out / "config.yaml").read_text()) if (out / "config.yaml").is_file() else {}
    return bool(rows) and config.get("max_steps", -1) in (-1, max(r["step"] for r in rows))


def _launch_here(
    cfg: PipelineConfig, config_path: Path, train_run: RunRef, sft_path: str, server_url: str | None, out: Path
) -> None:
    """One machine: `accelerate launch` here, with the vLLM server beside it when one is configured."""
    logger = get_run_logger()
    log_path = out / "train.log"
    server = cfg.launch.vllm_server
    cmd = launch_command(cfg.launch, config_path)
    env = _training_env(cfg, train_run)
    server_devices, training_devices = split_devices(
        server.devices, visible_cuda_devices(env) if server.enabled and server.devices else []
    )
    if training_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = training_devices
    server_log = out / "vllm_server.log"
    slot = gpu_slot(cfg.launch.gpu_concurrency_limit)
    try:
        with slot, _vllm_server(cfg, sft_path, server_url, server_devices, server_log) as running:
            if running is not None:
                logger.info("vLLM server healthy at %s (pid %d); log %s", running.url, running.pid, server_log)
                tracking.set_tags(train_run, {"rloo.vllm_server_url": running.url})
            logger.info("launching: %s", " ".join(cmd))
            outcome = run_in_process_group(
                cmd,
                env=env,
                cwd=None,  # the flow run's working directory, so relative config paths mean the same to both
                log_path=log_path,
                on_line=ThrottledLineLogger(logger, cfg.launch.log_interval_seconds),
                timeout_seconds=cfg.launch.timeout_seconds,
                kill_grace_seconds=cfg.launch.kill_grace_seconds,
            )
    except LaunchTimeout as err:
        raise TimeoutError(f"launch.timeout_seconds: training {err}; the process group was killed") from None
    finally:
        tracking.log_artifact(train_run, log_path, "logs")
        if server.enabled and server_log.exists():
            tracking.log_artifact(train_run, server_log, "logs")
    record_exit(train_run, outcome.returncode, outcome.tail)
    raise_for_exit(outcome.returncode, outcome.tail, log_path)


def _node_launch(cfg: PipelineConfig, out: Path, train_run: RunRef):
    """The node runs of a multi-node launch (cancelled whatever ends the block), or nothing on one machine."""
    if cfg.launch.num_machines == 1:
        return nullcontext()
    return NodeLaunch(cfg, out, train_run, withhold_env=_withheld(cfg))


def _world_size(cfg: PipelineConfig) -> int:
    """Training processes over all machines: `launch.num_processes` (required with several), else the profile's."""
    if cfg.launch.num_processes is not None:
        return cfg.launch.num_processes
    import yaml

    profile = resolve_profile(cfg.launch.profile, dict(os.environ))
    return int((yaml.safe_load(profile.read_text()) or {}).get("num_processes", 1))


def _withheld(cfg: PipelineConfig) -> list[str]:
    return [cfg.evaluation.judge.api_key_env] if cfg.evaluation.judge.api_key_env else []


def _training_env(cfg: PipelineConfig, train_run: RunRef) -> dict[str, str]:
    """The worker's environment minus the judge's key, plus launch.env, launch secrets and the MLflow run."""
    withhold = set(_withheld(cfg))
    extra = {
        **cfg.launch.env,
        **secret_env(cfg.launch.secret_env, "launch.secret_env"),
        "MLFLOW_TRACKING_URI": train_run.tracking_uri,
        "MLFLOW_RUN_ID": train_run.run_id,
        "PYTHONUNBUFFERED": "1",
        "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "5"),
    }
    return child_env(dict(os.environ), withhold, extra)


def _vllm_server(cfg: PipelineConfig, model_path: str, url: str | None, devices: str | None, log_path: Path):
    """The vLLM server of `launch.vllm_server` while training runs, or nothing when it is not enabled."""
    server = cfg.launch.vllm_server
    if not server.enabled or url is None:
        return nullcontext()
    port = int(url.rsplit(":", 1)[1])
    cmd = serve_command(server, model_path, port, dtype=cfg.train.dtype, seed=cfg.train.seed)
    withhold = set(_withheld(cfg))
    extra = {**server.env, "PYTHONUNBUFFERED": "1"}
    if devices is not None:
        extra["CUDA_VISIBLE_DEVICES"] = devices
    get_run_logger().info("starting the vLLM server: %s", " ".join(cmd))
    return running_vllm_server(
        cmd,
        url=url,
        env=child_env(dict(os.environ), withhold, extra),
        log_path=log_path,
        startup_timeout_s=server.startup_timeout_s,
        kill_grace_seconds=cfg.launch.kill_grace_seconds,
    )


def gpu_slot(limit_name: str | None):
    """Holds one slot of a Prefect global concurrency limit while training, when one is configured."""
    if not limit_name:
        return nullcontext()
    from prefect.concurrency.sync import concurrency

    # strict: a misspelt or missing limit fails here, not silently; a lease hiccup must not kill hours of training.
    return concurrency(
        limit_name.format(hostname=socket.gethostname()), occupy=1, strict=True, raise_on_lease_renewal_failure=False
    )
