"""Tests for rloo_engine.reward_sources: reward model scoring, reward functions, and their weighted combination.

The reward functions below are referenced by import path (`tests.engine.test_rewards:number_reward`),
the way a config names them.
"""

from __future__ import annotations

import asyncio
import importlib
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError
from rloo_engine.reward_sources import (
    RewardError,
    RewardModelSource,
    RewardSource,
    build_reward_sources,
    compute_rewards,
    load_reward_function,
)
from rloo_engine.testing import tiny_models

HERE = "tests.engine.test_rewards"
TEXTS = ["the cat", "a quick brown fox jumps over the lazy dog", "sun", "the big red house in the garden sings"]


# ---------------------------------------------------------------- reward functions used by path


def number_reward(completions, **kwargs):
    """float(completion), or None for "-"."""
    return [None if c == "-" else float(c) for c in completions]


def trl_style_chat_reward(completions, **kwargs):
    """How TRL's docs write a reward for conversational data: the reply's content, parsed as a number."""
    return [float(c[0]["content"]) for c in completions]


def skip_reward(completions, skip, **kwargs):
    """10.0, or None where the dataset column `skip` is true."""
    return [None if s else 10.0 for s in skip]


async def async_answer_reward(prompts, completions, completion_ids, answer, **kwargs):
    await asyncio.sleep(0)
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


def length_from_ids(completion_ids, **kwargs):
    return [len(ids) for ids in completion_ids]


def always_none(completions, **kwargs):
    return [None] * len(completions)


def raising_reward(completions, **kwargs):
    raise ValueError("boom")


async def async_raising_reward(completions, **kwargs):
    raise KeyError("missing judge")


def wrong_length_reward(completions, **kwargs):
    return [1.0]


def string_reward(completions, **kwargs):
    return ["good"] * len(completions)


NOT_CALLABLE = 3

_ARRIVED: set[str] = set()


async def _meet(name: str) -> None:
    """Returns once both async rewards have started; only possible if they run concurrently."""
    _ARRIVED.add(name)
    for _ in range(400):
        if {"a", "b"} <= _ARRIVED:
            return
        await asyncio.sleep(0.005)
    raise TimeoutError(f"{name}: the other async reward never started; they ran one after another")


async def meet_a(completions, **kwargs):
    await _meet("a")
    return [1.0] * len(completions)


async def meet_b(completions, **kwargs):
    await _meet("b")
    return [2.0] * len(completions)


def _funcs(*names):
    return [load_reward_function(f"{HERE}:{n}") for n in names]


def _score(sources, completions, weights=None, clip_range=None, **columns):
    n = len(completions)
    return compute_rewards(
        sources, weights, clip_range, ["p"] * n, completions, [[1, 2]] * n, columns
    )


# ---------------------------------------------------------------- loading reward functions


def test_loaded_function_is_a_reward_source_named_by_path():
    source = load_reward_function(f"{HERE}:number_reward")
    assert isinstance(source, RewardSource)
    assert source.name == "number_reward" and source.import_path == f"{HERE}:number_reward"
    assert source(prompts=["p"], completions=["2.5"], completion_ids=[[1]]) == [2.5]


def test_async_function_can_be_called_directly():
    source = load_reward_function(f"{HERE}:async_answer_reward")
    assert source(prompts=["p", "p"], completions=["cat", "dog"], completion_ids=[[1], [2]], answer=["cat", "cat"]) == [
        1.0,
        0.0,
    ]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg.mod:fn", r"no_such_pkg.mod:fn: module 'no_such_pkg.mod' not found"),
        (f"{HERE}:no_such_fn", rf"{HERE}:no_such_fn: {HERE} has no attribute 'no_such_fn'"),
        (f"{HERE}:NOT_CALLABLE", rf"{HERE}:NOT_CALLABLE: NOT_CALLABLE is a int, not callable"),
        ("no_colon", r"'no_colon'; expected an import path"),
    ],
)
def test_load_reward_function_errors_name_the_path(path, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_function(path)


def test_a_module_whose_import_fails_is_named_as_failing_not_missing(tmp_path, monkeypatch):
    (tmp_path / "needs_missing_dep.py").write_text("import no_such_dependency_xyz\n\ndef fn(**kw):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=r"importing module 'needs_missing_dep' failed: No module named 'no_such_depend"):
        load_reward_function("needs_missing_dep:fn")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rloo_engine.demo.task:gold_reward", "rloo_engine.demo.toy_task:gold_reward"),
        ("rloo_engine.rewards:FunctionRewardSource", "rloo_engine.reward_sources:FunctionRewardSource"),
        ("rloo_engine.sampling:TokenSampler", "rloo_engine.generation.sampling:TokenSampler"),
        ("rloo_engine.vllm_serve:main", "rloo_engine.generation.vllm_serve:main"),
    ],
)
def test_a_moved_module_in_a_config_names_its_new_path(old, new):
    with pytest.raises(ConfigError, match=rf"reward_funcs: {old}: module .* was moved in rloo-pipeline; write '{new}'"):
        load_reward_function(old)
    assert load_reward_function(new).name == new.rpartition(":")[2]


# ---------------------------------------------------------------- combination


def test_weights_none_values_and_scorable_mask():
    result = _score(_funcs("number_reward", "skip_reward"), ["1", "2", "-", "-"], weights=[2.0, 0.5],
                    skip=[False, True, False, True])
    nan = math.nan
    assert result.rewards.dtype == torch.float32
    assert result.rewards.tolist() == [7.0, 4.0, 5.0, 0.0]
    assert torch.equal(result.per_source.isnan(), torch.tensor([[False, False], [False, True], [True, False], [True, True]]))
    assert torch.allclose(result.per_source, torch.tensor([[1, 10], [2, nan], [nan, 10], [nan, nan]]), equal_nan=True)
    assert result.scorable.tolist() == [True, True, True, False]
    assert result.names == ["number_reward", "skip_reward"]


def test_weights_default_to_one():
    result = _score(_funcs("number_reward", "skip_reward"), ["1", "-"], skip=[False, False])
    assert result.rewards.tolist() == [11.0, 10.0]


def test_all_none_source_leaves_rows_unscorable_but_nan_free():
    result = _score(_funcs("always_none"), ["a", "b"])
    assert result.rewards.tolist() == [0.0, 0.0]
    assert result.scorable.tolist() == [False, False]


def test_clip_range_applies_to_the_weighted_sum_as_in_trl():
    # Row 0: 2 * -3 + 0.5 * 10 = -1 (inside the range; clipping each source first would give -1.25).
    # Row 1: 2 * 0.5 = 1.0; row 2: 2 * 3 = 6 -> 1.5.
    result = _score(_funcs("number_reward", "skip_reward"), ["-3", "0.5", "3"], weights=[2.0, 0.5],
                    clip_range=(-1.5, 1.5), skip=[False, True, True])
    assert torch.allclose(
        result.per_source, torch.tensor([[-3.0, 10.0], [0.5, math.nan], [3.0, math.nan]]), equal_nan=True
    )  # each source's raw score, as TRL logs `rewards/<name>/mean`
    assert result.rewards.tolist() == [-1.0, 1.0, 1.5]


def test_conversational_completions_reach_reward_functions_and_models_as_trl_passes_them():
    """A reward function written for `trl rloo` on chat data indexes completion[0]["content"]."""
    from rloo_engine.data import as_assistant_messages

    prompts = [[{"role": "user", "content": "hi"}]] * 2
    completions = [as_assistant_messages("1.5"), as_assistant_messages("2")]
    result = compute_rewards(_funcs("trl_style_chat_reward"), None, None, prompts, completions, [[1], [2]], {})
    assert result.rewards.tolist() == [1.5, 2.0]


def test_extra_columns_and_completion_ids_reach_functions():
    result = compute_rewards(
        _funcs("async_answer_reward", "length_from_ids"), None, None,
        ["p", "p"], ["a cat", "a dog"], [[1, 2, 3], [4]], {"answer": ["cat", "cat"]},
    )
    assert result.per_source.tolist() == [[1.0, 3.0], [0.0, 1.0]]


def test_async_functions_run_concurrently():
    importlib.import_module(HERE)._ARRIVED.clear()
    result = _score(_funcs("meet_a", "meet_b"), ["x"])
    assert result.rewards.tolist() == [3.0]


@pytest.mark.parametrize(
    ("funcs", "message"),
    [
        (("number_reward", "raising_reward"), rf"reward_funcs\[1\] {HERE}:raising_reward raised ValueError: boom"),
        (("async_raising_reward",), rf"reward_funcs\[0\] {HERE}:async_raising_reward raised KeyError: 'missing judge'"),
        (("wrong_length_reward",), rf"reward_funcs\[0\] {HERE}:wrong_length_reward returned 1 values; expected 3"),
        (("string_reward",), rf"reward_funcs\[0\] {HERE}:string_reward returned a str at row 0; expected a float"),
    ],
)
def test_bad_reward_functions_raise_reward_error_naming_them(funcs, message):
    with pytest.raises(RewardError, match=message):
        _score(_funcs(*funcs), ["1", "2", "3"])


def test_weight_count_must_match_sources():
    with pytest.raises(RewardError, match=r"reward_weights: \[1.0\] has 1 entries; expected 2"):
        _score(_funcs("number_reward", "number_reward"), ["1"], weights=[1.0])


# ---------------------------------------------------------------- reward model


def _direct_score(path, text):
    """Scores one unpadded text with the saved model and its own tokenizer, the plain HF way."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return model(**tok(text, return_tensors="pt")).logits[0, 0].item()


def test_reward_model_with_other_tokenizer_retokenizes_text(reward_model_other_tokenizer, policy_tokenizer):
    rm = RewardModelSource(str(reward_model_other_tokenizer))
    prompt, completion = "the cat sat", " on the mat"
    policy_ids = policy_tokenizer(completion)["input_ids"]
    assert rm.tokenizer(completion)["input_ids"] != policy_ids  # genuinely different tokenizers
    [score] = rm([prompt], [completion], [policy_ids])
    assert score == pytest.approx(_direct_score(reward_model_other_tokenizer, prompt + completion), abs=1e-5)


def test_reward_model_conversational_prompt_uses_its_chat_template(reward_model_other_tokenizer):
    rm = RewardModelSource(str(reward_model_other_tokenizer))
    messages = [{"role": "user", "content": "what sat on the mat"}]
    assert rm.text(messages, "the cat") == "<|user|>what sat on the mat\n<|assistant|>the cat\n"
    [score] = rm([messages], ["the cat"], [[1]])
    assert score == pytest.approx(_direct_score(reward_model_other_tokenizer, rm.text(messages, "the cat")), abs=1e-5)


def test_reward_model_without_chat_template_joins_roles(reward_model_other_tokenizer):
    rm = RewardModelSource(str(reward_model_other_tokenizer))
    rm.tokenizer.chat_template = None
    assert rm.text([{"role": "user", "content": "hi"}], "yes") == "user: hi\nassistant: yes"


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_batched_scores_equal_one_at_a_time(reward_model, padding_side):
    rm = RewardModelSource(str(reward_model), batch_size=8)
    rm.tokenizer.padding_side = padding_side
    lengths = [len(rm.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert len(set(lengths)) > 1  # rows really are padded
    batched = rm([""] * len(TEXTS), TEXTS)
    rm.batch_size = 1
    singles = rm([""] * len(TEXTS), TEXTS)
    assert torch.allclose(torch.tensor(batched), torch.tensor(singles), atol=1e-5)
    assert len(set(batched)) == len(TEXTS)  # a real signal, not one pooled position for all rows


@pytest.mark.parametrize("arch", ["roberta", "llama", "qwen2"])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_engine_score_equals_the_reward_models_own_forward(tmp_path, policy_tokenizer, arch, padding_side):
    # RoBERTa-family models number positions after padding_idx; 0-based position ids shift every score.
    path = tiny_models.build_reward_model(tmp_path / arch, policy_tokenizer, arch=arch, seed=3)
    rm = RewardModelSource(str(path), batch_size=8)
    rm.tokenizer.padding_side = padding_side
    prompts, completions = ["the cat sat", "a dog ran on the mat and the tree was red", "red"], [" on it", " blue", ""]
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        own = [model(**tokenizer(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in zip(prompts, completions)]
    assert rm(prompts, completions) == pytest.approx(own, abs=1e-5)
    assert len({round(x, 6) for x in own}) == 3  # three different scores: a real comparison


def test_score_is_read_at_last_token_even_when_pad_equals_eos(reward_model):
    rm = RewardModelSource(str(reward_model), batch_size=8)
    rm.tokenizer.pad_token = rm.tokenizer.eos_token
    rm.model.config.pad_token_id = rm.tokenizer.pad_token_id
    texts = ["the cat<eos>", "a quick brown fox jumps<eos>", "the cat"]
    batched = rm([""] * 3, texts)
    rm.batch_size = 1
    assert torch.allclose(torch.tensor(batched), torch.tensor(rm([""] * 3, texts)), atol=1e-5)
    assert batched[0] != pytest.approx(batched[2])  # the trailing eos is scored, not skipped as padding


def test_reward_model_with_two_labels_is_rejected(tmp_path, policy_tokenizer):
    path = tiny_models.build_reward_model(tmp_path / "rm2", policy_tokenizer, num_labels=2)
    with pytest.raises(ConfigError, match=rf"^reward_model: {path} has num_labels=2; a reward model must have num_labels=1$"):
        RewardModelSource(str(path))


def test_missing_reward_model_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match=rf"reward_model_name_or_path: {tmp_path / 'nope'} could not be loaded"):
        RewardModelSource(str(tmp_path / "nope"))


# ---------------------------------------------------------------- from the config


def test_build_reward_sources_puts_reward_model_first(qwen2_model, reward_model):
    cfg = RLOOConfig(
        model_name_or_path=str(qwen2_model),
        reward_model_name_or_path=str(reward_model),
        reward_funcs=[f"{HERE}:number_reward", f"{HERE}:skip_reward"],
        reward_weights=[0.0, 1.0, 2.0],
        dataset_name="unused.jsonl",
    )
    sources = build_reward_sources(cfg, "cpu")
    assert isinstance(sources[0], RewardModelSource)
    assert [s.name for s in sources] == ["reward_model", "number_reward", "skip_reward"]
    result = compute_rewards(
        sources, cfg.reward_weights, None, ["p", "p"], ["1", "-"], [[1], [2]], {"skip": [False, False]}
    )
    assert torch.isfinite(result.per_source[:, 0]).all()  # the reward model scored both rows
    assert result.rewards.tolist() == [21.0, 20.0]  # its weight is 0.0


def test_rows_are_batched_by_length_so_short_rows_are_not_padded_to_long_ones(reward_model):
    rm = RewardModelSource(str(reward_model), batch_size=2)
    long, short = "a quick brown fox jumps over the lazy dog " * 3, "the cat"
    texts = [long, short, long, short]  # in this order, each batch would pad a short row to the long one
    processed = []
    handle = rm.model.register_forward_pre_hook(lambda module, args, kwargs: processed.append(kwargs["input_ids"].shape),
                                                with_kwargs=True)
    try:
        scores = rm([""] * 4, texts)
    finally:
        handle.remove()
    n_long, n_short = (len(rm.tokenizer(t)["input_ids"]) for t in (long, short))
    assert sorted(processed) == sorted([(2, n_long), (2, n_short)])  # not two (2, n_long) batches
    assert scores[0] == pytest.approx(scores[2]) and scores[1] == pytest.approx(scores[3])  # back in input order
    assert scores[0] != pytest.approx(scores[1])
