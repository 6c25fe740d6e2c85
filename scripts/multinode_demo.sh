#!/usr/bin/env bash
# Multi-node RLOO on one machine: a Prefect server, a controller worker and two "node" workers on loopback (separate
# working dirs, one shared output root), then `rlhf-pipeline/on-demand` with launch.num_machines: 2 on a tiny config.
# Prints the flow run's final state and the train run's world size; exits 0 when the run Completed; stops everything
# it started. State: $MULTINODE_DEMO_DIR (default ./.rloo-multinode); MLflow's store: $MULTINODE_DEMO_DIR/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec "${RLOO_VENV:-.venv}/bin/python" scripts/multinode_demo.py "$@"
