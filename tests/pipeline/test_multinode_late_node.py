"""A machine that starts late still joins: rank 0 launches at once, the second node's worker appears only
`LATE_S` seconds later (a pod or job waiting for its GPU), within `launch.nodes.start_timeout_s`. Its own pool
workers, so no other worker picks the second node's run up early."""

from __future__ import annotations

import json
import time

import pytest

from tests.pipeline.conftest import start_node_worker
from tests.pipeline.test_multinode import TWO_NODES, node_flow_runs, run_dir_of

pytestmark = pytest.mark.slow
LATE_S = 20


def test_a_node_whose_worker_starts_late_joins_within_the_start_timeout(deployed):
    early = start_node_worker(deployed, "node-early")
    late = None
    try:
        flow_run_id, _ = deployed.run("rlhf-pipeline/on-demand", "--param",
                                      f"overrides={json.dumps({**TWO_NODES, 'train.max_steps': 4})}", watch=False)
        # Rank 0 is picked up by the one worker there is, launches, and waits in its rendezvous for the other.
        deadline = time.monotonic() + 180
        while not any(r.name.endswith("node-0") and r.state and r.state.name == "Running"
                      for r in node_flow_runs(deployed, flow_run_id)):
            assert time.monotonic() < deadline, deployed.failure_report(flow_run_id, None, early.log_tail(60))
            time.sleep(1)
        time.sleep(LATE_S)
        late = start_node_worker(deployed, "node-late")
        run = deployed.wait_for_state(flow_run_id, {"Completed", "Failed", "Crashed"}, timeout=420)
        assert run.state.name == "Completed", deployed.failure_report(flow_run_id, None, early.log_tail(80),
                                                                      late.log_tail(80))
        runs = {r.name.rsplit("-", 1)[-1]: r for r in node_flow_runs(deployed, flow_run_id)}
        started = {rank: r.start_time for rank, r in runs.items()}
        assert (started["1"] - started["0"]).total_seconds() >= LATE_S  # it really started late
        logs = "\n".join(deployed.logs(str(r.id)) for r in runs.values())
        assert f"rank 0 waits up to {int(TWO_NODES['launch.nodes.start_timeout_s']) + 300} s" in logs
        run_dir = run_dir_of(deployed, flow_run_id)
        assert (run_dir / "train" / "final" / "model.safetensors").is_file()
    finally:
        early.stop()
        if late is not None:
            late.stop()
