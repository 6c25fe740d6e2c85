"""Completion generation from model paths, and a full evaluation generating policy and SFT completions."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from rloo_engine import cli as rloo_cli
from rloo_engine.evaluation import EvalConfig, EvalGenerationConfig, run_evaluation
from rloo_engine.evaluation import generate as generate_module
from rloo_engine.evaluation.data import EvalPrompt, prompt_id, read_jsonl
from rloo_engine.evaluation.generate import generate_completions, generate_or_reuse
from rloo_engine.testing.tiny_models import synthetic_corpus
from tests.evaluation.eval_helpers import write_jsonl

TEXTS = synthetic_corpus(num_lines=7, seed=5)  # prompts of different lengths, so batches need padding


def _prompts(texts=TEXTS) -> list[EvalPrompt]:
    return [EvalPrompt(prompt_id(t), t) for t in texts]


def test_batched_greedy_generation_equals_one_prompt_at_a_time(qwen2_model):
    prompts = _prompts()
    batched = generate_completions(
        str(qwen2_model),
        prompts,
        EvalGenerationConfig(max_new_tokens=6, batch_size=4),
        field="policy_model_path",
        progress=False,
    )
    single = generate_completions(
        str(qwen2_model),
        prompts,
        EvalGenerationConfig(max_new_tokens=6, batch_size=1),
        field="policy_model_path",
        progress=False,
    )
    assert batched == single  # left padding and the length sort change nothing
    assert set(batched) == {p.prompt_id for p in prompts} and all(isinstance(c, str) for c in batched.values())


def test_chat_prompts_use_the_chat_template(qwen2_model):
    prompts = _prompts([[{"role": "user", "content": "the cat sat on the mat"}]])
    out = generate_completions(
        str(qwen2_model), prompts, EvalGenerationConfig(max_new_tokens=4), field="policy_model_path", progress=False
    )
    assert list(out) == [prompt_id([{"role": "user", "content": "the cat sat on the mat"}])]


def test_generated_completions_are_saved_with_stable_ids_and_reused(qwen2_model, tmp_path, monkeypatch):
    prompts = _prompts()
    out = tmp_path / "policy.jsonl"
    gen = EvalGenerationConfig(max_new_tokens=4)
    first = generate_or_reuse(str(qwen2_model), prompts, gen, out, field="policy_model_path", progress=False)
    rows = read_jsonl(out)
    assert [r["prompt_id"] for r in rows] == [prompt_id(r["prompt"]) for r in rows] == [p.prompt_id for p in prompts]

    def must_not_run(*args, **kwargs):
        raise AssertionError("generated again although the saved completions match")

    monkeypatch.setattr(generate_module, "generate_completions", must_not_run)
    assert generate_or_reuse(str(qwen2_model), prompts, gen, out, field="policy_model_path", progress=False) == first
    with pytest.raises(AssertionError, match="generated again"):  # other options: the old file is not reused
        generate_or_reuse(
            str(qwen2_model),
            prompts,
            EvalGenerationConfig(max_new_tokens=5),
            out,
            field="policy_model_path",
            progress=False,
        )


def test_a_bad_model_path_is_a_config_error_naming_the_option(tmp_path):
    from rloo_engine.evaluation import ConfigError

    with pytest.raises(ConfigError, match="sft_model_path: cannot load"):
        generate_completions(
            str(tmp_path / "nope"), _prompts(), EvalGenerationConfig(), field="sft_model_path", progress=False
        )


def test_full_evaluation_generating_policy_and_sft_from_model_paths(qwen2_model, llama_model, tmp_path, capsys):
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl", [{"prompt": t, "summary": f"human summary {i}"} for i, t in enumerate(TEXTS)]
    )
    values = {
        "prompts": str(prompts),
        "reference_column": "summary",
        "generation": {"max_new_tokens": 5, "batch_size": 4},
        "judge": {"backend": "python", "function": "tests.evaluation.eval_helpers:prefer_longer"},
        "progress": False,
    }
    report = run_evaluation(
        EvalConfig.model_validate(values), policy_path=qwen2_model, sft_path=llama_model, output_dir=tmp_path / "out"
    )
    assert set(report.pairings) == {"policy_vs_reference", "sft_vs_reference", "policy_vs_sft"}
    assert all(r.n == len(TEXTS) and r.n_valid == len(TEXTS) for r in report.pairings.values())
    assert report.paired_difference is not None
    for side in ("policy", "sft", "reference"):
        rows = read_jsonl(report.completions[side])
        assert [r["prompt_id"] for r in rows] == [prompt_id(t) for t in TEXTS]
    saved = json.loads(report.results_path.read_text())
    assert saved["config"]["policy_model_path"] == str(qwen2_model)  # the override is what was recorded

    # the same run from the command line reuses the generated completions and the cached judgments
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump(values))
    code = rloo_cli.main(
        [
            "evaluate",
            "--config",
            str(config),
            "--policy",
            str(qwen2_model),
            "--sft",
            str(llama_model),
            "--output_dir",
            str(tmp_path / "out"),
            "--no_progress",
        ]
    )
    assert code == 0
    again = json.loads(report.results_path.read_text())
    assert again["usage"]["judgments_made"] == 0
    assert {n: p["win_rate"] for n, p in again["pairings"].items()} == {
        n: r.win_rate for n, r in report.pairings.items()
    }


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_backend_without_vllm_is_a_config_error_naming_the_option(qwen2_model):
    from rloo_engine.config_base import ConfigError

    with pytest.raises(ConfigError, match=r"generation.backend: 'vllm', but vllm is not installed"):
        generate_completions(str(qwen2_model), _prompts(), EvalGenerationConfig(backend="vllm"), field="policy")
    with pytest.raises(ValueError, match=r"device: 'cuda:1' with backend: 'vllm'; vLLM places the model itself"):
        EvalGenerationConfig(backend="vllm", device="cuda:1")
