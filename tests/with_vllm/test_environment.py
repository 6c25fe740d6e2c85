"""The vLLM tests run vLLM as a user's install does: no variable in their environment moves its engine."""

from __future__ import annotations

from pathlib import Path

from tests.with_vllm.environment import AT_START, LAYOUT_VARIABLES

REPO = Path(__file__).resolve().parents[2]


def test_no_variable_moves_vllms_engine_in_the_tests_environment():
    assert not {k: AT_START[k] for k in LAYOUT_VARIABLES if k in AT_START}


def test_the_vllm_test_script_and_ci_set_none_of_them():
    for path in ("scripts/test_vllm.sh", ".ci/run", "tests/with_vllm/conftest.py"):
        text = (REPO / path).read_text()
        assert not [k for k in LAYOUT_VARIABLES if f"{k}=" in text or f'"{k}"' in text], path
