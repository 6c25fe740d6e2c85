"""Peak memory and time of one log-prob forward + backward through the LM head: the engine's two paths against the
readable math.

    OMP_NUM_THREADS=2 python bench/chunked_logprobs_memory.py                # the default grid, ~5 min on 2 CPU cores
    python bench/chunked_logprobs_memory.py --hidden 2048 4096 --vocab 151936 --positions 128 --output r.json

Three paths over the same head: `reference`, `algorithm.token_log_probs` under autograd (what the engine ran
until the full-logits path below: float32 copies of the logits kept for the backward, the gradient built as more
(B, T, V) tensors); `full`, `logits_logprobs.logits_token_log_probs` (the engine's default: the logits kept, their
gradient written over them); `chunked`, `chunked_logprobs: true`. The ratios are each path's over `reference`.

`chunked_logprobs` trades the (positions, V) logits for per-chunk recomputation, but its backward
accumulates the head's weight gradient, a (V, H) float32 tensor, which the full path also makes. So the
lever pays while positions x V dominates V x H, i.e. for long completions, and stops paying at large
hidden sizes with short completions. This bench isolates the head: hidden states (B, T, H) and an
`nn.Linear(H, V)` head, both requiring grad, the sum of the sampled tokens' log-probs as the loss.

Each case runs in a fresh subprocess. Peak memory is `ru_maxrss` after the step minus `ru_maxrss` once the
inputs exist, so it is the step's own high-water mark over its inputs, parameters and their gradients
included in neither (the gradients are made by the step, and both paths make the same ones).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PATHS = ("reference", "full", "chunked")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 2048, 4096], help="hidden sizes H")
    p.add_argument("--vocab", type=int, nargs="+", default=[512, 32000, 151936], help="vocabulary sizes V")
    p.add_argument("--positions", type=int, nargs="+", default=[128, 512],
                   help="completion tokens per micro-batch, B x T (16 x 8 and 16 x 32 by default: short completions)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="bfloat16: the head's matmuls under CPU autocast, as `bf16: true` runs them")
    p.add_argument("--output", help="write the results as JSON here")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: H,V,positions,path,dtype in this process
    return p.parse_args(argv)


def max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_case(hidden: int, vocab: int, positions: int, path: str, dtype: str) -> dict:
    import torch

    from rloo_engine.algorithm import token_log_probs
    from rloo_engine.logits_logprobs import logits_token_log_probs
    from rloo_engine.logprobs import chunked_token_log_probs

    torch.manual_seed(0)
    rows = 16
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(rows, positions // rows, hidden, requires_grad=True)
    tokens = torch.randint(vocab, (rows, positions // rows))
    before = max_rss_mib()
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        if path == "chunked":
            logps, _ = chunked_token_log_probs(h, head, tokens)
        elif path == "full":
            logps, _ = logits_token_log_probs([head(h)], tokens)
        else:
            logps, _ = token_log_probs(head(h), tokens)
    logps.sum().backward()
    seconds = time.perf_counter() - start
    return {"hidden": hidden, "vocab": vocab, "positions": positions, "path": path, "dtype": dtype,
            "peak_mib": round(max_rss_mib() - before, 1), "seconds": round(seconds, 3),
            "weight_mib": round(vocab * hidden * 4 / 2**20, 1), "logits_mib": round(positions * vocab * 4 / 2**20, 1)}


def measure(hidden: int, vocab: int, positions: int, path: str, dtype: str) -> dict:
    case = f"{hidden},{vocab},{positions},{path},{dtype}"
    proc = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(results: list[dict]) -> list[dict]:
    """One row per shape: each engine path's peak and time as ratios of the reference path's."""
    by_shape: dict[tuple, dict[str, dict]] = {}
    for r in results:
        by_shape.setdefault((r["hidden"], r["vocab"], r["positions"]), {})[r["path"]] = r
    rows = []
    for (hidden, vocab, positions), paths in sorted(by_shape.items()):
        reference = paths["reference"]
        row = {"hidden": hidden, "vocab": vocab, "positions": positions, "reference_peak_mib": reference["peak_mib"]}
        for path in ("full", "chunked"):
            row[f"{path}_peak_mib"] = paths[path]["peak_mib"]
            row[f"{path}_peak_ratio"] = round(paths[path]["peak_mib"] / max(reference["peak_mib"], 1.0), 2)
            row[f"{path}_time_ratio"] = round(paths[path]["seconds"] / reference["seconds"], 2)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.case:
        hidden, vocab, positions, path, dtype = args.case.split(",")
        print(json.dumps(run_case(int(hidden), int(vocab), int(positions), path, dtype)))
        return
    results = []
    for hidden in args.hidden:
        for vocab in args.vocab:
            for positions in args.positions:
                for path in PATHS:  # alternating, so a load change hits both paths of a shape alike
                    results.append(measure(hidden, vocab, positions, path, args.dtype))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    rows = compare(results)
    print(f"{'H':>5} {'V':>7} {'B*T':>5} {'reference MiB':>13} {'full MiB':>9} {'peak':>5} {'time':>5} "
          f"{'chunked MiB':>12} {'peak':>5} {'time':>5}   (peak, time: / reference)")
    for r in rows:
        print(f"{r['hidden']:>5} {r['vocab']:>7} {r['positions']:>5} {r['reference_peak_mib']:>13} "
              f"{r['full_peak_mib']:>9} {r['full_peak_ratio']:>5} {r['full_time_ratio']:>5} "
              f"{r['chunked_peak_mib']:>12} {r['chunked_peak_ratio']:>5} {r['chunked_time_ratio']:>5}")
    print(f"load average {os.getloadavg()[0]:.2f}, dtype {args.dtype}, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"cases": results, "comparison": rows, "load_average": os.getloadavg()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
