"""The vLLM server beside training, without vLLM: its command, the CUDA device split, and the process-group
lifecycle (health wait, exit before health, stop) on a stand-in HTTP server."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import VLLMServerSection
from rloo_engine.pipeline.vllm_server import (
    VLLMServerConfigError,
    VLLMServerFailed,
    pick_port,
    running_vllm_server,
    serve_command,
    split_devices,
)
from rloo_engine.services import group_alive


def test_serve_command_passes_the_options_and_extra_args_after_the_separator():
    settings = VLLMServerSection(enabled=True, devices=["2", "3"], gpu_memory_utilization=0.8,
                                 extra_args=["--max-num-seqs", "64"])
    cmd = serve_command(settings, "/ckpt/sft", 8123, dtype="bfloat16", seed=7)
    assert cmd[1:4] == ["-m", "rloo_engine", "vllm-serve"]
    joined = " ".join(cmd)
    assert "--model /ckpt/sft --host 127.0.0.1 --port 8123 --tensor_parallel_size 2 --dtype bfloat16" in joined
    assert joined.endswith("--seed 7 --gpu_memory_utilization 0.8 -- --max-num-seqs 64")


def test_devices_split_between_server_and_training():
    assert split_devices(None, ["0", "1"]) == (None, None)
    assert split_devices(["3"], ["0", "1", "2", "3"]) == ("3", "0,1,2")
    with pytest.raises(ConfigError, match=r"devices: \['4'\] are not among this node's CUDA devices"):
        split_devices(["4"], ["0", "1"])
    with pytest.raises(ConfigError, match="leave at least one for training"):
        split_devices(["0", "1"], ["0", "1"])
    with pytest.raises(ConfigError, match="this node has no CUDA device"):
        split_devices(["0"], [])


STAND_IN = textwrap.dedent("""
    import http.server, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a child, like vLLM's engine core
    if sys.argv[2] == "exit":
        print("error: unrecognized arguments: --bogus", flush=True); sys.exit(2)
    time.sleep(0.5)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def stand_in(tmp_path, port: int, mode: str) -> list[str]:
    script = tmp_path / "server.py"
    script.write_text(STAND_IN)
    return [sys.executable, str(script), str(port), mode]


def test_the_server_is_healthy_inside_and_its_whole_group_gone_after(tmp_path):
    port = pick_port("127.0.0.1", None)
    url = f"http://127.0.0.1:{port}"
    with running_vllm_server(stand_in(tmp_path, port, "serve"), url=url, env={}, log_path=tmp_path / "s.log",
                             startup_timeout_s=30, kill_grace_seconds=2) as server:
        assert group_alive(server.pid)
    assert not group_alive(server.pid)


def test_a_server_that_exits_before_health_names_its_url_and_log_and_leaves_nothing(tmp_path):
    port = pick_port("127.0.0.1", None)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "vllm_server.log"
    with pytest.raises(VLLMServerConfigError) as err:  # exit 2: a usage error, not retried
        with running_vllm_server(stand_in(tmp_path, port, "exit"), url=url, env={}, log_path=log,
                                 startup_timeout_s=30, kill_grace_seconds=2):
            pytest.fail("never healthy")
    message = str(err.value)
    assert f"the vLLM server at {url} exited with code 2 before answering /health" in message
    assert str(log) in message and "unrecognized arguments: --bogus" in message


def test_a_server_that_never_gets_healthy_times_out_and_is_killed(tmp_path):
    port = pick_port("127.0.0.1", None)
    cmd = [sys.executable, "-c", "import time; time.sleep(600)"]
    with pytest.raises(VLLMServerFailed, match=r"did not answer /health within startup_timeout_s=1 s"):
        with running_vllm_server(cmd, url=f"http://127.0.0.1:{port}", env={}, log_path=tmp_path / "s.log",
                                 startup_timeout_s=1, kill_grace_seconds=1):
            pass
