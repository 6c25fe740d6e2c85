"""`launch.gpu_concurrency_limit`: training holds one slot of the node's global concurrency limit."""

from __future__ import annotations

import socket

import pytest

from tasks.train import gpu_slot

pytestmark = pytest.mark.slow


def test_training_holds_the_node_slot_and_a_missing_limit_fails_loudly(services):
    name = f"gpu-node-{socket.gethostname()}"
    services.cli("gcl", "create", name, "--limit", "1")
    with services.prefect_settings():
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            with gpu_slot("gpu-node-{hostname}"):
                assert client.read_global_concurrency_limit_by_name(name).active_slots == 1
            assert client.read_global_concurrency_limit_by_name(name).active_slots == 0
        with pytest.raises(Exception, match="gpu-node-nowhere"):
            with gpu_slot("gpu-node-nowhere"):
                pass
