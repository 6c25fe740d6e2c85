"""The run summary as MLflow and Prefect render it: separate header lines, a one-line headline."""

from __future__ import annotations

from rloo_engine.pipeline.run_summary import headline, render_markdown


def summary(passed: bool = True, error: str | None = None) -> dict:
    return {
        "output_dir": "/runs/1",
        "mlflow": {"tracking_uri": "http://mlflow:5000", "experiment_id": "1", "run_id": "abc123", "run_url": "http://x"},
        "stages": {},
        "error": error,
        "evaluation": {
            "policy_vs_sft": {"win_rate": 0.75, "ci_low": 0.6, "ci_high": 0.9, "lc_win_rate": 0.7, "n": 32,
                              "n_parse_error": 0, "n_api_error": 0, "consistency_rate": 0.9},
            "policy_vs_reference": {"win_rate": 0.4, "ci_low": 0.3, "ci_high": 0.5, "lc_win_rate": 0.4, "n": 32,
                                    "n_parse_error": 0, "n_api_error": 0, "consistency_rate": 0.9},
        },
        "promotion": {"passed": passed, "reason": "r", "registered": passed, "model_name": "m", "alias": "candidate",
                      "version": "3" if passed else None, "model_uri": "models:/m@candidate" if passed else None},
    }


def test_headline_has_the_gate_pairing_with_its_ci_and_the_decision():
    assert headline(summary()) == (
        "policy_vs_sft win rate 75.0% (95% CI [60.0%, 90.0%], n=32); gate passed; registered models:/m@candidate (version 3)"
    )
    assert headline(summary(passed=False)).endswith("; gate failed")
    assert headline({"error": "EngineCrashed: boom"}) == "Failed: EngineCrashed: boom"


def test_header_lines_are_list_items_so_markdown_keeps_them_apart():
    lines = render_markdown("RLHF pipeline", summary()).splitlines()
    assert lines[:3] == ["# RLHF pipeline", "", f"**{headline(summary())}**"]
    run_line = lines.index("- MLflow parent run: http://x")
    assert lines[run_line + 1] == "- output directory: `/runs/1`"
    assert lines[run_line - 1] == "" and lines[run_line + 2] == ""  # a list, apart from the paragraphs around it
