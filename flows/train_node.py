"""Flow `train-node`: one machine of a multi-node RLOO run (deployment `train-node/node`).

The `rlhf-pipeline` train task starts one run of it per machine (`launch.num_machines > 1`) with that machine's
`NodeSpec`, on the nodes' work pool, and waits for all of them: nobody runs it by hand. It checks the shared output
directory, reports its address (`rloo-node-address` artifact), then runs this machine's `accelerate launch` (or, for
`role: vllm_server`, the vLLM server until the train task cancels it). docs/pipeline.md, "Multi-node".
"""

from __future__ import annotations

from prefect import flow

from rloo_engine.pipeline.multinode import NodeSpec
from tasks.node_run import join_run, publish_report, serve_vllm_on_this_node, train_on_this_node


@flow(name="train-node", log_prints=True)
def train_node(spec: NodeSpec) -> dict:
    """One node of a multi-node training run (started by the `rlhf-pipeline` train task, not by hand)."""
    report = join_run(spec)
    if spec.role == "vllm_server":
        serve_vllm_on_this_node(spec, report)  # publishes its report once the server is healthy
        return {"node": spec.name, "host": report.host}
    publish_report(report, spec)
    return train_on_this_node(spec, report)
