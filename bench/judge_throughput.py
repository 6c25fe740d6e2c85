"""Judge throughput: 1,000 judgments at concurrency 32 against a local server with 100 ms latency per call.

Prints elapsed / ideal, where ideal = 1000 x 0.1 s / 32 = 3.125 s (every slot busy all the time).
Target: <= 1.2. The elapsed time is the judging stage of a real `run_evaluation` (the judge's aiohttp client,
retries, rate limiter, budget guard, SQLite cache write per judgment, progress bookkeeping), on
500 prompts x 2 orders. The fake server runs in its own process so that it does not compete with
the client for the interpreter lock, as a real endpoint would not.

The number measures the client, so it needs CPU to itself: on a 2-core machine that other jobs keep
busy it rises (the client waits for a core). For that reason the bench also times a minimal
raw-socket client doing the same 1,000 requests against the same server: the floor this machine
allows right now (about 1.03-1.06 when idle; 1000 requests take 32 rounds).

    python bench/judge_throughput.py [--judgments 1000] [--concurrency 32] [--latency 0.1]
    python bench/judge_throughput.py --mode batch     # the same judgments through the Batch API path

`--mode batch` sends the judgments as one OpenAI Batch API batch to the fake server's Files and
Batches endpoints (the batch finishes on the second poll, polls 10 ms apart) and prints the client's
time per judgment for writing the JSONL file, uploading, polling, downloading and mapping the rows
back (with a cache write each): the overhead the batch path adds, since a real batch's wait is hours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rloo_engine.evaluation import EvalConfig, run_evaluation  # noqa: E402


def write_eval_set(root: Path, n_prompts: int) -> tuple[Path, Path]:
    prompts = [
        f"Post {i}: the quick brown fox jumps over the lazy dog near river {i}. TL;DR:" for i in range(n_prompts)
    ]
    prompt_file, policy_file = root / "prompts.jsonl", root / "policy.jsonl"
    prompt_file.write_text(
        "".join(json.dumps({"prompt": p, "reference": f"fox jumps {i}"}) + "\n" for i, p in enumerate(prompts))
    )
    policy_file.write_text(
        "".join(
            json.dumps({"prompt": p, "completion": f"a good fox summary {i}"}) + "\n" for i, p in enumerate(prompts)
        )
    )
    return prompt_file, policy_file


def start_server(latency_s: float) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rloo_engine.testing.fake_openai_server", "--latency", str(latency_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        raise RuntimeError(f"fake server did not start (printed {line!r})")
    return proc, int(line.split()[1])


async def raw_socket_baseline(port: int, n_requests: int, concurrency: int) -> float:
    """Seconds for `n_requests` bare HTTP/1.1 requests over `concurrency` keep-alive sockets (no client library)."""
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "Summary A:\nx\n\nSummary B:\ny\n\nFIRST"}]}
    )
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    remaining = iter(range(n_requests))

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in remaining:
            writer.write(request)
            await writer.drain()
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--judgments", type=int, default=1000, help="judgments to make (even: two orders per prompt)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.1, help="server latency per call, seconds")
    parser.add_argument("--mode", choices=("live", "batch"), default="live", help="judge.mode to measure")
    args = parser.parse_args()

    os.environ["RLOO_BENCH_JUDGE_KEY"] = "bench-key"
    server, port = start_server(args.latency)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            prompt_file, policy_file = write_eval_set(root, args.judgments // 2)
            cfg = EvalConfig.model_validate(
                {
                    "prompts": str(prompt_file),
                    "reference_column": "reference",
                    "policy_completions": str(policy_file),
                    "judge": {
                        "backend": "openai",
                        "model": "fake-judge",
                        "base_url": f"http://127.0.0.1:{port}/v1",
                        "api_key_env": "RLOO_BENCH_JUDGE_KEY",
                        "max_concurrency": args.concurrency,
                        "mode": args.mode,
                        "batch_poll_initial_s": 0.01,
                        "batch_poll_max_s": 0.01,
                    },
                    "output_dir": str(root / "out"),
                    "progress": False,
                }
            )
            baseline = 0.0
            if args.mode == "live":
                baseline = asyncio.run(raw_socket_baseline(port, args.judgments, args.concurrency))
            started, cpu_started = time.perf_counter(), time.process_time()
            report = run_evaluation(cfg)
            total, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    finally:
        server.stdin.close()
        server.wait(timeout=10)

    made = report.usage.judgments_made
    if made != args.judgments or report.pairings["policy_vs_reference"].n_api_error:
        print(
            f"error: made {made} judgments ({report.usage.requests} requests); expected {args.judgments} without errors"
        )
        return 1
    elapsed = report.timings["judging_s"]
    if args.mode == "batch":
        rows = report.judge["batch"]["rows"]
        print(f"judgments: {made} through the Batch API path: {rows}")
        print(f"judging elapsed: {elapsed:.3f} s = {1000 * elapsed / made:.2f} ms per judgment (whole run: {total:.3f} s)")
        print(f"client CPU of run_evaluation: {1000 * cpu / made:.2f} ms per judgment")
        return 0
    ideal = args.judgments * args.latency / args.concurrency
    ratio = elapsed / ideal
    print(f"judgments: {made} at concurrency {args.concurrency}, server latency {args.latency * 1000:.0f} ms")
    print(f"judging elapsed: {elapsed:.3f} s   ideal: {ideal:.3f} s   (whole run_evaluation: {total:.3f} s)")
    print(f"client CPU of run_evaluation: {1000 * cpu / made:.2f} ms per judgment (the server shares the machine)")
    print(f"raw-socket client, same requests: {baseline:.3f} s = {baseline / ideal:.3f} x ideal (the floor here, now)")
    print(f"elapsed / ideal = {ratio:.3f}   (target <= 1.2: {'PASS' if ratio <= 1.2 else 'FAIL'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
