"""Writes docs/configuration.md from the config classes (`--check` fails if the file is out of date)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rloo_engine.config_docs import markdown_table

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "docs" / "configuration.md"
# (heading, "module:Class", where it is used); a class that does not exist yet is skipped.
SECTIONS = [
    ("Training engine: `RLOOConfig`", "rloo_engine.config:RLOOConfig",
     "`rloo-engine train --config cfg.yaml` and every `--flag`; the pipeline's `train:` section."),
    ("Evaluation: `EvalConfig`", "rloo_engine.evaluation:EvalConfig",
     "`rloo-engine evaluate --config eval.yaml`; the pipeline's `evaluation:` section."),
    ("Pipeline: `PipelineConfig`", "rloo_engine.pipeline.config:PipelineConfig",
     "`python -m flows.rlhf_pipeline --config ...` and the Prefect deployments' `cfg` parameter."),
]


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
