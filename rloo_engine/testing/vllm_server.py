"""A real vLLM server for tests and benches: `rloo-engine vllm-serve` in a process group of its own, stopped with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import requests

from rloo_engine.lifetime import die_with_parent
from rloo_engine.services import ServiceExited, free_port, group_alive, kill_process_group, wait_for_health


class Server:
    def __init__(self, model: Path, log: Path, port: int | None = None, *extra: str, threads: int | None = 1,
                 cpus: set[int] | None = None):
        """`threads`: OMP_NUM_THREADS of the server (1 keeps tests beside it responsive; None: vLLM's own choice).
        `cpus`: the only CPUs its processes may run on, its worker's OpenMP threads bound to them (a bench gives
        the server and the trainer a core each: vLLM's processes busy-poll for a second after each step)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        repo = str(Path(__file__).resolve().parents[2])  # a checkout on PYTHONPATH, as the caller runs it
        pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("OMP_NUM_THREADS", None)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a real server runs its engine core as vLLM ships it
        if cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cpus)))
        parent = os.getpid()

        def prepare() -> None:
            die_with_parent(parent)  # a killed test or bench leaves no server behind
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rloo_engine", "vllm-serve", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), "--dtype", "float32", "--seed", "0", *extra],
            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=prepare)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 240) -> None:
        try:
            wait_for_health(self.url, timeout, running=lambda: self.proc.poll() is None)
        except ServiceExited:
            raise RuntimeError(f"vLLM server exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}") from None
        except TimeoutError:
            raise RuntimeError(f"vLLM server not healthy in {timeout} s:\n{self.log.read_text()[-4000:]}") from None

    def get(self, path: str):
        return requests.get(f"{self.url}{path}", timeout=60).json()

    def post(self, path: str, body: dict):
        reply = requests.post(f"{self.url}{path}", json=body, timeout=60)
        reply.raise_for_status()
        return reply.json()

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The server's log-prob of each of ids[1:] given the tokens before it."""
        model = self.get("/v1/models")["data"][0]["id"]
        reply = self.post("/v1/completions", dict(model=model, prompt=ids, max_tokens=1, prompt_logprobs=0,
                                                  temperature=1.0))
        return [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], reply["choices"][0]["prompt_logprobs"][1:])]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 30 s; returns once no process of the group is left."""
        kill_process_group(self.proc.pid, 30, leader=self.proc)
        self.proc.wait(30)

    def kill(self) -> None:
        """As a crash: SIGKILL to the server and its engine core."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        kill_process_group(self.proc.pid, 0, leader=self.proc)

    def group_alive(self) -> bool:
        """Whether any process of the server's group still runs (zombies do not count)."""
        self.proc.poll()  # reap the server itself
        return group_alive(self.proc.pid)
