"""Docs that are generated from code must match the code."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_reference_is_current():
    proc = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_engine_option_is_documented():
    from rloo_engine.config import RLOOConfig

    text = (ROOT / "docs" / "configuration.md").read_text()
    for name, field in RLOOConfig.model_fields.items():
        assert field.description, f"RLOOConfig.{name} has no description"
        assert f"`{name}`" in text
