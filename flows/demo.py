"""The offline demo: build tiny assets once, run the real `rlhf_pipeline` flow through Prefect, print the summary.

    python -m flows.demo            # full demo (about 10 minutes on 2 CPU cores)
    python -m flows.demo --smoke    # same code path, seconds of training (CI)

State lives under `--home` (default ./.rloo-demo): Prefect's SQLite database (a temporary local API
server runs for the duration of the command only), MLflow's SQLite store and artifacts, the cached
assets and every run's outputs. MLFLOW_TRACKING_URI / PREFECT_API_URL, when set, are used instead.
The judge is an offline stand-in for GPT-4: the task's hidden gold rule through the `python` backend.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

MLFLOW_UI_PORT, PREFECT_UI_PORT = 5000, 4200  # defaults of the printed UI commands (--mlflow-port, --prefect-port)
GOLD = "rewards/gold_reward/mean"


def configure_environment(home: Path) -> dict[str, str]:
    """Points Prefect and MLflow at stores under `home` (unless the user chose others); must run before importing them."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect' / 'prefect.db'}",
        "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}",
    }
    for key, value in env.items():
        os.environ.setdefault(key, value)
    os.environ.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        # One torch thread: these models are too small to gain from two, and lose badly when cores are shared.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PREFECT_LOGGING_LEVEL": os.environ.get("PREFECT_LOGGING_LEVEL", "INFO"),
        # The demo trains for about a minute; MLflow's 10 s default would give the train run few system metrics.
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "2"),
        "TRANSFORMERS_VERBOSITY": "error", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The first start migrates a fresh SQLite database, which takes a while on 2 busy cores.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
    })
    # Known-harmless library notices; anything else still prints.
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*select_dtypes.*")
    import datasets
    import transformers

    # Per-file load bars of the libraries; the demo shows its own bars for each long step.
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    return {k: os.environ[k] for k in env}


def demo_config(assets, home: Path, smoke: bool) -> dict[str, Any]:
    """The PipelineConfig of the demo, from the recommended settings in rloo_engine/demo/settings.py."""
    from rloo_engine.demo import settings

    train = dict(settings.SMOKE_TRAIN if smoke else settings.DEMO_TRAIN)
    functions, weights = train.pop("reward_funcs"), train.pop("reward_weights")
    return {
        "sft": {"source": str(assets.sft_dir)},
        "reward": {"model": str(assets.reward_model_dir), "functions": functions, "weights": weights},
        "data": {"train_prompts": str(assets.train_prompts), "eval_prompts": str(assets.eval_prompts),
                 "reference_column": "reference"},
        "train": {**train, "disable_tqdm": False},
        "launch": {"profile": "cpu", "retries": 1, "retry_delay_seconds": 0, "env": dict(settings.DEMO_LAUNCH_ENV)},
        "evaluation": {
            "judge": {"backend": "python", "function": "rloo_engine.demo.toy_task:gold_judge"},
            "num_samples": 16 if smoke else 192,
            "trace_judgments": 200,  # the UI example; 576 would add ~1 min on 2 cores (0.1 s per trace)
            "generation": settings.SMOKE_EVAL_GENERATION if smoke else settings.DEMO_EVAL_GENERATION,
            "progress": True,
        },
        # Smoke mode trains 4 steps on 16 prompts, too few to win; a zero bar still exercises registration.
        "tracking": {"experiment": "rloo-demo", "registered_model": "rloo-demo-policy",
                     "promotion": {"min_ci_low": 0.0 if smoke else 0.5, "min_n": 1 if smoke else 50,
                                   "alias": "candidate"}},
        "output_root": str(home / "runs"),
    }


def ensure_experiment(tracking_uri: str, name: str, artifacts: Path) -> None:
    """Creates the experiment with its artifacts under the demo home (MLflow's default is ./mlruns)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if client.get_experiment_by_name(name) is None:
        client.create_experiment(name, artifact_location=artifacts.resolve().as_uri())


def gold_score_trend(train_dir: Path) -> str:
    """First -> last logged `rewards/gold_reward/mean`: whether the reward model's gains are real ones."""
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return "n/a"
    values = [row[GOLD] for row in map(json.loads, path.read_text().splitlines()) if GOLD in row]
    return f"{values[0]:.4f} -> {values[-1]:.4f}" if values else "n/a"


def render_summary(s: dict[str, Any], stores: dict[str, str], smoke: bool,
                   mlflow_port: int = MLFLOW_UI_PORT, prefect_port: int = PREFECT_UI_PORT) -> str:
    """The demo's summary as Markdown: printed in the terminal and published as a Prefect artifact."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    num = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
    train, ev, promo = s.get("train") or {}, s.get("evaluation") or {}, s.get("promotion") or {}
    exp, run = s["mlflow"]["experiment_id"], s["mlflow"]["run_id"]
    rows = [
        ("reward (learned RM), start -> end", f"{num(train.get('reward_start'))} -> {num(train.get('reward_end'))}"),
        ("gold score (hidden rule, weight 0), start -> end", gold_score_trend(Path(s["output_dir"]) / "train")),
        ("KL to the SFT policy at the end (per token)", num(train.get("kl_end"))),
    ]
    for name in ("policy_vs_sft", "policy_vs_reference", "sft_vs_reference"):
        if r := ev.get(name):
            rows.append((f"win rate {name.replace('_vs_', ' vs ')}",
                         f"{pct(r['win_rate'])}  95% CI [{pct(r['ci_low'])}, {pct(r['ci_high'])}]  n={r['n']}"))
            rows.append(("  length-controlled", pct(r.get("lc_win_rate"))))
    gate = "n/a" if not promo else f"{'PASSED' if promo['passed'] else 'not passed'}: {promo['reason']}"
    if smoke and promo:
        gate += (" (smoke mode proves the path runs, not that the policy learns: a few steps and a gate threshold "
                 "of 0, so registration runs too; the full demo shows learning)")
    rows += [("promotion gate", gate),
             (f"MLflow run (UI on port {mlflow_port}, command below)",
              f"http://127.0.0.1:{mlflow_port}/#/experiments/{exp}/runs/{run}")]
    table = ["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    # The Prefect UI asks the API for data at the URL built from PREFECT_SERVER_API_PORT; `--port` alone
    # would move the server but leave the UI calling :4200, so the port is set through that variable.
    prefect_env = (f"PREFECT_HOME={stores['PREFECT_HOME']} "
                   f"PREFECT_API_DATABASE_CONNECTION_URL={stores['PREFECT_API_DATABASE_CONNECTION_URL']} "
                   f"PREFECT_SERVER_API_PORT={prefect_port}")
    return "\n".join([
        f"# RLOO demo summary{' (smoke mode)' if smoke else ''}", "", *table, "",
        "Judge: the task's hidden gold rule (an offline stand-in for a GPT-4 judge; see docs/demo.md).", "",
        "Open the UIs on these stores; for another port change the number in the command (for Prefect it is",
        "PREFECT_SERVER_API_PORT, which also tells its UI where the API is; `--port` alone leaves the UI calling :4200):",
        "",
        f"    .venv/bin/mlflow ui --backend-store-uri {stores['MLFLOW_TRACKING_URI']} --port {mlflow_port}"
        f"    # http://127.0.0.1:{mlflow_port}",
        f"    {prefect_env} .venv/bin/prefect server start    # http://127.0.0.1:{prefect_port}", "",
    ])


def main(argv: list[str] | None = None) -> int:
    from rloo_engine.argparsing import StrictArgumentParser

    parser = StrictArgumentParser(prog="python -m flows.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny assets and a few training steps (CI)")
    parser.add_argument("--home", default=".rloo-demo", help="where every store, asset and output goes")
    parser.add_argument("--mlflow-port", type=int, default=MLFLOW_UI_PORT,
                        help="port of the MLflow UI in the printed command and run link")
    parser.add_argument("--prefect-port", type=int, default=PREFECT_UI_PORT,
                        help="port of the Prefect UI in the printed command")
    args = parser.parse_args(argv)
    home = Path(args.home).resolve()
    stores = configure_environment(home)

    from rloo_engine.demo.assets import build_demo_assets  # imported after the environment is set

    assets = build_demo_assets(home / ("assets-smoke" if args.smoke else "assets"), smoke=args.smoke)
    print(f"demo assets: {assets.root} ({'cached' if assets.from_cache else 'built'}; "
          f"reward model held-out accuracy {assets.summary.get('rm_heldout_accuracy', float('nan')):.2f})")
    ensure_experiment(stores["MLFLOW_TRACKING_URI"], "rloo-demo", home / "mlartifacts")

    from prefect import flow
    from prefect.artifacts import create_markdown_artifact

    from flows.rlhf_pipeline import rlhf_pipeline
    from rloo_engine.pipeline.config import build_pipeline_config

    @flow(name="rloo-demo", log_prints=False)
    def rloo_demo(cfg_values: dict[str, Any]) -> str:
        summary = rlhf_pipeline(build_pipeline_config(cfg_values))
        markdown = render_summary(summary, stores, args.smoke, args.mlflow_port, args.prefect_port)
        create_markdown_artifact(key="rloo-demo-summary", markdown=markdown, description="RLOO demo summary")
        return markdown

    print(rloo_demo(demo_config(assets, home, args.smoke)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
