"""A whole flow run with an OpenAI judge whose key comes from a Prefect Secret block, against a server that
echoes the key in error bodies and in replies: the key appears nowhere the run wrote (issue 23)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rloo_engine.testing.fake_openai_server import ChatRequest, FakeOpenAIServer, FakeReply, sensible

pytestmark = pytest.mark.slow

KEY = "sk-live-secret-scan-7f3a9c2e41b8d6"
BLOCK = "judge-key-scan"


def echoing_judge(req: ChatRequest) -> FakeReply:
    """First sight of a request: a 500 whose body echoes the key; then a verdict whose text echoes it too."""
    key = req.authorization.removeprefix("Bearer ")
    if req.seen_before == 0:
        return FakeReply(500, error_body={"error": {"message": f"upstream failed for key {key}", "type": "server_error"}})
    reply = sensible(req)
    reply.text = f"Reviewing with key {key}.\n{reply.text}"
    return reply


def _files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_the_judge_key_appears_nowhere_the_run_wrote(deployed):
    from prefect.blocks.system import Secret

    with deployed.services.prefect_settings():
        Secret(value=KEY).save(BLOCK, overwrite=True)
    with FakeOpenAIServer(echoing_judge) as server:
        judge = {"backend": "openai", "model": "fake-judge", "base_url": server.base_url, "api_key_env": "SCAN_JUDGE_KEY",
                 "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
        overrides = {"evaluation.judge": judge, "evaluation.api_key_secret": BLOCK,
                     "tracking.registered_model": "tiny-policy-scan"}
        flow_run_id, cli = deployed.run("rlhf-pipeline/on-demand", "--param", f"overrides={json.dumps(overrides)}")
        assert cli.returncode == 0, cli.stdout + cli.stderr + deployed.worker.log_tail(80)
    assert any(r.authorization == f"Bearer {KEY}" for r in server.requests)  # the block's key was used
    assert any(r.status == 500 for r in server.requests)  # and the echoing 500s were retried

    # Everything read back through the APIs: Prefect logs and artifacts, MLflow params, tags, artifacts, traces.
    assert KEY not in deployed.logs(flow_run_id)
    assert all(KEY not in json.dumps(a.data, default=str) for a in deployed.artifacts(flow_run_id))
    client = deployed.services.mlflow()
    for stage, run in deployed.mlflow_runs(flow_run_id).items():
        assert KEY not in json.dumps({**run.data.params, **run.data.tags}), stage
        local = Path(client.download_artifacts(run.info.run_id, "", dst_path=str(deployed.services.root / stage)))
        assert not _files_holding(local, KEY.encode()), stage
        for trace in client.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, max_results=500):
            assert KEY not in trace.to_json(), stage
    # And every byte on disk: the run directory (train.log, judgments.jsonl, results.json, the judge cache), the
    # MLflow and Prefect stores and the service logs.
    run_dir = Path(deployed.config["output_root"])
    assert not _files_holding(run_dir, KEY.encode())
    # not vacuous: the echoing replies were stored, with the key redacted
    assert {Path(p).name for p in _files_holding(run_dir, b"Reviewing with key ***.")} >= {
        "judgments.jsonl", "judge_cache.sqlite"}
    assert not _files_holding(deployed.services.root, KEY.encode())
