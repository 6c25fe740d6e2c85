"""Writes docs/configuration.md from the config classes (`--check` fails if the file is out of date)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rloo_engine import trl_fields
from rloo_engine.config_docs import markdown_table

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "configuration.md"
# (heading, "module:Class", where it is used); a class that does not exist yet is skipped.
SECTIONS = [
    ("Training engine: `RLOOConfig`", "rloo_engine.config:RLOOConfig",
     "`RLOOTrainer(args=RLOOConfig(...))` in Python (`from rloo_engine import RLOOConfig, RLOOTrainer`, as TRL's), "
     "`rloo-engine train --config cfg.yaml` and every `--flag`; the pipeline's `train:` section."),
    ("Evaluation: `EvalConfig`", "rloo_engine.evaluation:EvalConfig",
     "`rloo-engine evaluate --config eval.yaml`; the pipeline's `evaluation:` section."),
    ("Pipeline: `PipelineConfig`", "rloo_engine.pipeline.config:PipelineConfig",
     "`python -m flows.rlhf_pipeline --config ...` and the Prefect deployments' `cfg` parameter."),
]

TRL_SECTION = (
    "\n### Every `trl rloo` option (TRL 1.16)\n\n"
    "What each field of `trl rloo` (its script arguments, TRL's `RLOOConfig` with transformers' `TrainingArguments`, "
    "`ModelConfig`, `DatasetMixtureConfig`) does in `rloo-engine train`, on the command line and in a `--config` "
    "file alike; from `rloo_engine/trl_fields.py`, which tests/engine/test_trl_parity.py checks against TRL's own "
    "parser. "
)


def render() -> str:
    parts = ["# Configuration reference\n",
             "Generated from the config classes by `python scripts/config_reference.py`; do not edit by hand.\n"]
    for heading, target, used in SECTIONS:
        module, _, name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
        parts.append(f"\n## {heading}\n\nUsed by {used}\n\n{markdown_table(cls)}")
        if target == "rloo_engine.config:RLOOConfig":
            parts.append(TRL_SECTION + trl_fields.markdown_table())
    return "".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    text = render()
    if parser.parse_args().check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date; run: python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
