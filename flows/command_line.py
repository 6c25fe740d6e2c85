"""Command line of the flows: `python -m flows.<flow> --config cfg.yaml [--set key=value ...]`.

Without PREFECT_API_URL, Prefect runs the flow against a temporary local server; with it, the run
is recorded on that server like a deployment run. MLflow needs MLFLOW_TRACKING_URI (or
`tracking.tracking_uri` in the config).
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from rloo_engine.argparsing import StrictArgumentParser
from rloo_engine.config_base import ConfigError
from rloo_engine.pipeline.config import PipelineConfig


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values are YAML, so `3e-6`, `true`, `[a, b]` get their types."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set: {pair!r}; expected dotted.key=value, e.g. train.learning_rate=3e-6")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def run_from_command_line(flow_fn, argv: list[str], prog: str, with_policy: bool = False) -> int:
    parser = StrictArgumentParser(prog=prog, description=(flow_fn.description or "").split("\n")[0])
    parser.add_argument("--config", required=True, help="PipelineConfig YAML file (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one option by its dotted name, e.g. --set train.max_steps=20 (repeatable)",
    )
    if with_policy:
        parser.add_argument(
            "--policy", help="checkpoint dir, hub id or MLflow model URI (default: the registered candidate)"
        )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    # MLflow prints a "View run" line per finished stage run to stdout; the summary below carries the link.
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    try:
        cfg = PipelineConfig.from_yaml(args.config, parse_overrides(args.overrides))
    except ConfigError as err:
        parser.exit(2, f"error: {err}\n")
    kwargs = {"policy": args.policy} if with_policy else {}
    summary = flow_fn(cfg, **kwargs)
    print(json.dumps(summary, indent=2, default=str) if args.json else format_summary(summary))
    return 0


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a few aligned lines for a terminal."""

    def pct(x: Any) -> str:
        return "  n/a" if x is None else f"{100 * x:5.1f}%"

    lines = []
    if train := s.get("train"):
        lines.append(
            f"reward      {train['reward_start']:.4f} -> {train['reward_end']:.4f} "
            f"({train['global_step']} steps), KL {train['kl_end'] if train['kl_end'] is not None else 'n/a'}"
        )
    for name, r in (s.get("evaluation") or {}).items():
        lines.append(
            f"{name:<20} win {pct(r['win_rate'])} CI [{pct(r['ci_low'])}, {pct(r['ci_high'])}]  "
            f"LC {pct(r['lc_win_rate'])}  n={r['n']}  parse_err={r['n_parse_error']} api_err={r['n_api_error']}"
        )
    if p := s.get("promotion"):
        lines.append(f"promotion   {'PASSED' if p['passed'] else 'not promoted'}: {p['reason']}")
        if p["registered"]:
            lines.append(f"registered  {p['model_uri']} (version {p['version']})")
    m = s["mlflow"]
    lines.append(f"mlflow      {m['run_url'] or m['run_id'] + ' at ' + m['tracking_uri']}")
    lines.append(f"outputs     {s['output_dir']}")
    return "\n".join(lines)
