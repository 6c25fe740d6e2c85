"""`rloo-engine evaluate`: a standalone win-rate evaluation from a YAML EvalConfig.

    rloo-engine evaluate --config eval.yaml [--policy DIR] [--sft DIR] [--output_dir DIR]

Exit status: 0 on success, 2 for a configuration error (the message names the option) or a judge
endpoint that refuses the key, model or call (401/403/404: fixed in the config, never by retrying), 1 when
the evaluation stopped otherwise (budget reached, results that would mislead).
"""

from __future__ import annotations

import argparse
import logging
import sys

from rloo_engine.argparsing import StrictArgumentParser
from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import load_eval_config
from rloo_engine.evaluation.errors import EvaluationError, JudgeEndpointError
from rloo_engine.evaluation.report import format_summary
from rloo_engine.evaluation.runner import run_evaluation


def parser() -> argparse.ArgumentParser:
    p = StrictArgumentParser(
        prog="rloo-engine evaluate",
        description="Pairwise win rates of policy / SFT / reference completions under an LLM judge.",
    )
    p.add_argument("--config", required=True, help="YAML file of EvalConfig options (see docs/evaluation.md)")
    p.add_argument("--policy", help="policy model directory to generate completions from (overrides the config)")
    p.add_argument("--sft", help="SFT model directory to generate completions from (overrides the config)")
    p.add_argument(
        "--output_dir", help="where results.json, judgments.jsonl and completions/ go (overrides the config)"
    )
    p.add_argument("--max_prompts", type=int, help="evaluate only the first N prompts (overrides the config)")
    p.add_argument("--no_progress", action="store_true", help="hide progress bars")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    # Our progress and warnings at INFO; HTTP client libraries stay at WARNING (one line per request is noise).
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rloo_engine").setLevel(logging.INFO)
    overrides = {"max_prompts": args.max_prompts, "progress": False if args.no_progress else None}
    try:
        cfg = load_eval_config(args.config, overrides)
        report = run_evaluation(cfg, policy_path=args.policy, sft_path=args.sft, output_dir=args.output_dir)
    except (ConfigError, JudgeEndpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EvaluationError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(format_summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
