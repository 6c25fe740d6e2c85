"""The Prefect-free parts of multi-node launches: configuration, node paths, the shared-directory token, the
failure report, and the launch command (which must really start every process it is asked for)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rloo_engine.pipeline.config import LaunchSection
from rloo_engine.pipeline.multinode import (
    TOKEN_NAME,
    NodeFailure,
    check_token,
    failure_message,
    map_paths,
    node_address,
    node_root,
)
from rloo_engine.pipeline.train_launch import launch_command
from rloo_engine.run.shared_output_dir import OutputDirNotShared


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"num_machines": 2, "machine_rank": 1}, "machine_rank: 1 is set by the pipeline"),
        ({"num_machines": 2, "main_process_ip": "10.0.0.1"}, "main_process_ip: '10.0.0.1' is set by the pipeline"),
        ({"num_machines": 2}, "num_processes: required with num_machines: 2"),
        ({"num_machines": 2, "num_processes": 3}, "num_processes: 3 does not divide over num_machines: 2"),
        ({"vllm_server": {"enabled": True, "placement": "node"}}, "placement: 'node' needs num_machines > 1"),
        ({"nodes": {"deployment": "train-node"}}, "deployment"),
    ],
)
def test_launch_section_refuses_what_multi_node_cannot_run(values, expected):
    with pytest.raises(ValueError, match=expected):
        LaunchSection(**values)


def test_paths_under_the_controllers_root_move_to_the_nodes_root(tmp_path):
    root = node_root("/mnt/outputs", {"RLOO_OUTPUT_ROOT": "/outputs"})
    assert root == Path("/outputs")
    config = {"output_dir": "/mnt/outputs/run/train", "model_name_or_path": "/mnt/outputs/run/sft",
              "dataset_name": "/data/prompts.jsonl", "reward_funcs": ["/mnt/outputs-other/x"], "seed": 3}
    mapped = map_paths(config, "/mnt/outputs", root)
    assert mapped == {"output_dir": "/outputs/run/train", "model_name_or_path": "/outputs/run/sft",
                      "dataset_name": "/data/prompts.jsonl", "reward_funcs": ["/mnt/outputs-other/x"], "seed": 3}
    assert node_root("/mnt/outputs", {}) == Path("/mnt/outputs")


def test_the_token_check_names_the_node_and_the_path_it_could_not_read(tmp_path, monkeypatch):
    monkeypatch.setattr("rloo_engine.pipeline.multinode.VISIBILITY_WAIT_S", 0.2)
    (tmp_path / TOKEN_NAME).write_text("abc")
    check_token(tmp_path, "abc", "node-1", "host-b")  # sees it: no error
    with pytest.raises(OutputDirNotShared, match=r"node-1 on host-b does not share .* holds another run's token"):
        check_token(tmp_path, "xyz", "node-1", "host-b")
    missing = tmp_path / "elsewhere"
    with pytest.raises(OutputDirNotShared, match=rf"{missing / TOKEN_NAME} cannot be read .*nothing was loaded"):
        check_token(missing, "abc", "node-1", "host-b")


def test_the_failure_report_names_the_node_that_failed_not_the_one_that_lost_its_peer():
    peer = NodeFailure(node="node-0", host="a", state="Failed", seconds=30.2,
                       message="EngineCrashed: exit code 1 ... RuntimeError: [gloo] Connection closed by peer")
    cause = NodeFailure(node="node-1", host="b", state="Failed", seconds=31.0,
                        message="EngineCrashed: the engine was killed by SIGKILL (often the OOM killer)")
    message = failure_message([peer, cause])
    assert message.startswith("node-1 on b failed (Failed) after 31 s: EngineCrashed: the engine was killed by SIGKILL")
    assert "then node-0 (Failed): EngineCrashed: exit code 1" in message
    # Two real failures: the first one is the cause.
    later = NodeFailure(node="node-0", host="a", state="Crashed", seconds=40, message="out of memory")
    assert failure_message([later, cause]).startswith("node-1 on b")


def test_the_node_address_is_the_configured_one_or_the_route_toward_the_api():
    assert node_address({"RLOO_NODE_ADDRESS": "10.1.2.3"}, "http://prefect:4200/api") == "10.1.2.3"
    assert node_address({}, "http://127.0.0.1:4200/api") == "127.0.0.1"


def test_the_cpu_profile_starts_every_process_it_is_asked_for(tmp_path):
    # The cpu profile has no distributed type: without --multi_gpu accelerate started ONE process for
    # `launch.num_processes: 2` (the pipeline's 2-process CPU runs were single-process).
    script = tmp_path / "world.py"
    script.write_text(
        "import torch.distributed as dist\nfrom accelerate import PartialState\n"
        "import sys\ns = PartialState(cpu=True)\n"
        # One file per rank: two ranks printing to one shared pipe interleave ("WORLDWORLD 0 2").
        "open(f'{sys.argv[1]}/world{s.process_index}', 'w').write(f'WORLD {s.process_index} {s.num_processes}')\n"
        "dist.destroy_process_group() if dist.is_initialized() else None\n"
    )
    cmd = launch_command(LaunchSection(profile="cpu", num_processes=2), tmp_path / "unused.yaml")
    assert cmd[-5:] == ["-m", "rloo_engine", "train", "--config", str(tmp_path / "unused.yaml")]
    # accelerate's default port, taken by another launch on this machine in the instant between its "is 29500 in
    # use?" probe and its listen (two runs started together: CI's two lanes failed with EADDRINUSE this way).
    with socket.socket() as other_launch:
        with contextlib.suppress(OSError):  # already held by a real one: the same situation
            other_launch.bind(("0.0.0.0", 29500))
        proc = subprocess.run(cmd[:-5] + [str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.read_text() for p in tmp_path.glob("world?")) == ["WORLD 0 2", "WORLD 1 2"]


def test_a_multi_node_command_carries_its_rank_and_rank_0s_address(tmp_path):
    launch = LaunchSection(profile="deepspeed_zero3", num_machines=2, num_processes=16)
    cmd = " ".join(launch_command(launch, tmp_path / "c.yaml", machine_rank=1, main_process_ip="10.0.0.5",
                                  main_process_port=29555))
    assert "--num_processes 16 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.5" in cmd
    assert "--deepspeed_multinode_launcher standard" in cmd and "--main_process_port 29555" in cmd
    assert "--multi_gpu" not in cmd  # DeepSpeed profiles have their own distributed type
    assert yaml.safe_load(Path(cmd.split("--config_file ")[1].split()[0]).read_text())["distributed_type"] == "DEEPSPEED"
    assert sys.executable in cmd


def test_one_machine_takes_a_free_port_unless_the_config_or_the_profile_names_one(tmp_path):
    def port_of(launch: LaunchSection) -> str | None:
        cmd = launch_command(launch, tmp_path / "c.yaml")
        return cmd[cmd.index("--main_process_port") + 1] if "--main_process_port" in cmd else None

    assert port_of(LaunchSection(profile="cpu", num_processes=2)) == "0"  # accelerate picks a free one
    assert port_of(LaunchSection(profile="cpu", num_processes=2, main_process_port=29555)) == "29555"
    assert port_of(LaunchSection(profile="cpu", num_processes=1)) is None  # one process listens on nothing
    profile = tmp_path / "own_port.yaml"
    profile.write_text(yaml.safe_dump({"distributed_type": "MULTI_CPU", "num_processes": 2, "main_process_port": 29600}))
    assert port_of(LaunchSection(profile=str(profile), num_processes=2)) is None  # the profile's port is used


def test_rank_0_waits_for_late_nodes_as_long_as_they_may_take_to_start(tmp_path):
    """Ranks 1..N-1 start only after rank 0 reported, each within `launch.nodes.start_timeout_s`: rank 0's
    rendezvous store must wait that long (torchrun's static default is 600 s whatever the pipeline allows)."""
    from rloo_engine.pipeline.train_launch import RENDEZVOUS_MARGIN_S

    launch = LaunchSection(profile="cpu", num_machines=2, num_processes=4, nodes={"start_timeout_s": 1800})
    cmd = launch_command(launch, tmp_path / "c.yaml", machine_rank=0, main_process_ip="10.0.0.5")
    assert cmd[cmd.index("--rdzv_conf") + 1] == f"timeout={1800 + RENDEZVOUS_MARGIN_S}"
    assert "--rdzv_conf" not in launch_command(LaunchSection(profile="cpu", num_processes=2), tmp_path / "c.yaml")


def test_the_collectives_use_the_interface_of_the_address_the_node_reported():
    from rloo_engine.pipeline.multinode import NodeSpec, interface_of, node_environment

    spec = NodeSpec(num_machines=2, output_root="/o", run_dir="/o/r", token="t", launch={})
    loopback = interface_of("127.0.0.1")
    assert loopback  # "lo" on Linux
    env = node_environment(spec, {"PATH": "/bin"}, {}, address="127.0.0.1")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == loopback
    chosen = node_environment(spec, {"PATH": "/bin", "NCCL_SOCKET_IFNAME": "ib0"}, {}, address="127.0.0.1")
    assert chosen["NCCL_SOCKET_IFNAME"] == "ib0" and "GLOO_SOCKET_IFNAME" not in chosen  # the user's choice stands
    assert "NCCL_SOCKET_IFNAME" not in node_environment(spec, {"PATH": "/bin"}, {}, address="203.0.113.9")
