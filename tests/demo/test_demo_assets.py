"""The offline demo's assets and synthetic task: built once and cached, trained for real, usable by the engine and the judge."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rloo_engine.demo import assets as demo_assets
from rloo_engine.demo import reward_model_training as demo_rm
from rloo_engine.demo import sft as demo_sft
from rloo_engine.demo import toy_task as task
from rloo_engine.demo.assets import MANIFEST, build_demo_assets, load_demo_assets
from rloo_engine.demo.settings import (
    DEMO_EVAL_GENERATION,
    DEMO_TRAIN,
    SMOKE_ASSETS,
    SMOKE_EVAL_GENERATION,
    SMOKE_TRAIN,
)

# Far smaller than smoke: for the tests that only exercise caching and the atomic rename.
TINY = dataclasses.replace(SMOKE_ASSETS, sft_examples=200, sft_steps=2, rm_steps=2, rm_heldout_pairs=8, eval_prompts=4)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread, and much faster when other jobs share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> demo_assets.DemoAssets:
    return build_demo_assets(tmp_path_factory.mktemp("demo") / "assets", smoke=True, progress=False)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def refuse_to_train(*args, **kwargs):
    raise AssertionError("a cached asset directory was rebuilt")


# ---------------------------------------------------------------- the gold rule and its judge


def test_gold_score_rewards_vivid_words_the_length_window_and_a_finished_sentence():
    prompt = task.make_prompt(("describe", "night", "child", "evening"))
    plain = "the old moon sits near the big star."
    vivid = "the golden moon sits near the bright star."
    rambling = vivid + " there is a owl by the cloud. a fox runs over the hill."
    cut_off = "the golden moon sits near the bright"
    assert task.gold_score(prompt, vivid) == pytest.approx(task.gold_score(prompt, plain) + 1.5)
    assert task.gold_score(prompt, rambling) < task.gold_score(prompt, vivid)
    assert task.gold_breakdown(prompt, cut_off)["finish"] == 0.0
    assert task.gold_breakdown(prompt, "the moonzz sits.")["fluency"] == -task.UNKNOWN_WORD_WEIGHT
    assert task.gold_score(prompt, vivid) <= 2.0


def test_gold_judge_prefers_the_higher_gold_score_in_either_slot_and_ties_on_equal():
    prompt = task.make_prompt(("write about", "water", "poet", "morning"))
    better, worse = "the bright fish rests by the golden boat.", "the old fish rests by the big boat."
    assert task.gold_judge(prompt, better, worse) == "A"
    assert task.gold_judge(prompt, worse, better) == "B"
    assert task.gold_judge(prompt, better, better) == "tie"
    same_score = "the golden fish rests by the bright boat."  # different words, equal gold score
    assert task.gold_score(prompt, same_score) == task.gold_score(prompt, better)
    assert task.gold_judge(prompt, better, same_score) == "tie"


def test_gold_judge_runs_as_the_evaluation_python_judge():
    from rloo_engine.evaluation.config import JudgeConfig
    from rloo_engine.evaluation.judges.base import SlotPair
    from rloo_engine.evaluation.judges.python_judge import PythonJudge

    judge = PythonJudge(JudgeConfig(backend="python", function="rloo_engine.demo.toy_task:gold_judge"))
    prompt = task.make_prompt(("describe", "farm", "friend", "winter"))
    judged = asyncio.run(judge.judge([SlotPair(prompt, "a gentle dog sits by the warm horse.", "a dog")]))
    assert [(j.status, j.verdict) for j in judged] == [("ok", "A")]


def test_gold_reward_is_an_rloo_reward_function_by_import_path():
    from rloo_engine.reward_sources import load_reward_function

    source = load_reward_function("rloo_engine.demo.toy_task:gold_reward")
    prompts = [task.make_prompt(("describe", "town", "child", "evening"))] * 2
    completions = ["the warm cat sits near the bright house.", "the cat"]
    scores = source(prompts=prompts, completions=completions, completion_ids=[[1], [2]])
    assert scores == [task.gold_score(p, c) for p, c in zip(prompts, completions)]
    assert scores[0] > scores[1]


def test_sft_data_is_mediocre_and_references_are_decent_under_the_gold_rule():
    import random

    rng = random.Random(0)
    train_specs, _ = task.prompt_specs(0)
    prompts = [task.sample_prompt(rng, train_specs) for _ in range(400)]
    sft = sum(task.gold_score(p, task.sft_completion(rng, p)) for p in prompts) / len(prompts)
    ref = sum(task.gold_score(p, task.reference_completion(rng, p)) for p in prompts) / len(prompts)
    assert sft < 0.0 < 0.8 < ref


def test_edited_completion_changes_one_gold_term():
    import random

    rng = random.Random(3)
    prompt = task.make_prompt(("describe", "spring", "poet", "morning"))
    text = "the old bee sits near the big flower. a small bird is by the tree."
    vivid = task.edited_completion(rng, prompt, text, "vivid")
    changed = {k for k, v in task.gold_breakdown(prompt, vivid).items() if v != task.gold_breakdown(prompt, text)[k]}
    assert changed == {"adjectives"}
    assert task.gold_score(prompt, vivid) > task.gold_score(prompt, text)
    assert task.gold_breakdown(prompt, task.edited_completion(rng, prompt, text, "truncate"))["finish"] == 0.0
    with pytest.raises(ValueError, match="kind: 'shout'"):
        task.edited_completion(rng, prompt, text, "shout")


# ---------------------------------------------------------------- built assets


def test_assets_have_prompts_and_held_out_eval_prompts_with_references(smoke):
    train = read_jsonl(smoke.train_prompts)
    evals = read_jsonl(smoke.eval_prompts)
    assert train and all(set(row) == {"prompt"} for row in train)
    assert len(evals) == SMOKE_ASSETS.eval_prompts
    assert all(row["reference"].strip() for row in evals)
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evals}
    assert smoke.summary["num_eval_prompts"] == len(evals)


def test_sft_training_lowers_the_completion_loss(smoke):
    assert smoke.summary["sft_final_loss"] < smoke.summary["sft_first_loss"] - 0.5


def test_sft_policy_loads_with_its_tokenizer_and_stops_with_eos(smoke):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smoke.sft_dir)
    tok = AutoTokenizer.from_pretrained(smoke.sft_dir)
    assert model.config.model_type == "qwen2"
    assert model.generation_config.eos_token_id == tok.eos_token_id is not None
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_completion_loss_is_only_on_completion_tokens():
    from rloo_engine.testing.tiny_models import train_tokenizer

    tok = train_tokenizer(["describe the night.\nthe moon."] * 10, vocab_size=300, chat_template=None)
    ids, labels = demo_sft.tokenize_example(tok, "describe the night.\n", "the moon.")
    prompt_len = len(tok("describe the night.\n", add_special_tokens=False)["input_ids"])
    assert labels[:prompt_len] == [demo_sft.IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:] == ids[prompt_len:] and ids[-1] == tok.eos_token_id


def test_reward_model_beats_chance_on_held_out_pairs(smoke):
    assert smoke.summary["rm_heldout_accuracy"] > 0.6
    assert smoke.summary["rm_final_loss"] < smoke.summary["rm_first_loss"]


def test_reward_model_scores_through_the_engine_reward_source_as_in_training(smoke):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rloo_engine.reward_sources import RewardModelSource

    source = RewardModelSource(str(smoke.reward_model_dir), batch_size=3)
    assert source.model.config.num_labels == 1 and source.model.config.pad_token_id is not None
    prompt = task.make_prompt(("describe", "woods", "sailor", "afternoon"))
    completions = ["the fox.", "the bright fox runs near the golden forest.", "a", "there is a deer by the big frog."]
    engine_scores = source([prompt] * len(completions), completions)
    model = AutoModelForSequenceClassification.from_pretrained(smoke.reward_model_dir).eval()
    with torch.no_grad():
        training_scores = demo_rm.score_texts(model, AutoTokenizer.from_pretrained(smoke.reward_model_dir),
                                              [prompt + c for c in completions])
    assert engine_scores == pytest.approx(training_scores.tolist(), abs=1e-4)


def test_bradley_terry_loss_is_small_when_chosen_scores_higher():
    chosen, rejected = torch.tensor([3.0, 2.0]), torch.tensor([-3.0, -2.0])
    assert demo_rm.bradley_terry_loss(chosen, rejected) < 0.05 < demo_rm.bradley_terry_loss(rejected, chosen)


# ---------------------------------------------------------------- caching and atomic builds


def test_second_build_reuses_the_cached_assets_without_training(smoke, monkeypatch):
    monkeypatch.setattr(demo_sft, "train_sft", refuse_to_train)
    monkeypatch.setattr(demo_rm, "train_reward_model", refuse_to_train)
    again = build_demo_assets(smoke.root, smoke=True, progress=False)
    assert again.from_cache and again.summary == smoke.summary
    assert again.sft_dir == smoke.sft_dir and again.reward_model_dir == smoke.reward_model_dir


def test_changed_settings_rebuild_and_replace_the_old_build(tmp_path):
    root = tmp_path / "assets"
    first = build_demo_assets(root, settings=TINY, progress=False)
    second = build_demo_assets(root, settings=dataclasses.replace(TINY, eval_prompts=3), progress=False)
    assert not second.from_cache and second.summary["key"] != first.summary["key"]
    assert len(read_jsonl(second.eval_prompts)) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets"]  # no staging or old copies left behind


def test_interrupted_build_leaves_the_previous_build_untouched(tmp_path, monkeypatch):
    root = tmp_path / "assets"
    first = build_demo_assets(root, settings=TINY, progress=False)
    manifest_before = (root / MANIFEST).read_text()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_rm, "train_reward_model", crash)
    with pytest.raises(KeyboardInterrupt):
        build_demo_assets(root, settings=dataclasses.replace(TINY, eval_prompts=2), progress=False)
    assert (root / MANIFEST).read_text() == manifest_before
    assert load_demo_assets(root).summary == first.summary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets"]


def test_interrupted_first_build_leaves_no_complete_looking_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(demo_rm, "train_reward_model", refuse_to_train)
    with pytest.raises(AssertionError):
        build_demo_assets(tmp_path / "assets", settings=TINY, progress=False)
    assert load_demo_assets(tmp_path / "assets") is None
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_replace_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=f"root: {tmp_path} exists, is not empty and has no manifest.json"):
        build_demo_assets(tmp_path, settings=TINY, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------- the recommended settings


@pytest.mark.parametrize("train", [DEMO_TRAIN, SMOKE_TRAIN])
def test_recommended_train_settings_are_valid_rloo_configs(train, tmp_path):
    from rloo_engine.config import build_config

    cfg = build_config({**train, "model_name_or_path": "sft", "reward_model_name_or_path": "rm",
                        "dataset_name": "prompts.jsonl", "output_dir": str(tmp_path)})
    assert cfg.num_generations >= 2 and cfg.reward_weights == [1.0, 0.0]


@pytest.mark.parametrize("generation", [DEMO_EVAL_GENERATION, SMOKE_EVAL_GENERATION])
def test_recommended_eval_generation_settings_are_valid(generation):
    from rloo_engine.evaluation.config import EvalGenerationConfig

    assert EvalGenerationConfig(**generation).model_dump(include=set(generation)) == generation


def test_smoke_rloo_run_trains_on_the_assets(smoke, tmp_path):
    """The assets plug into the engine as the demo uses them: SFT policy, reward model, prompt file."""
    from rloo_engine.config import build_config
    from rloo_engine.trainer import RLOOTrainer

    cfg = build_config({**SMOKE_TRAIN, "model_name_or_path": str(smoke.sft_dir),
                        "reward_model_name_or_path": str(smoke.reward_model_dir),
                        "dataset_name": str(smoke.train_prompts), "output_dir": str(tmp_path / "rloo"),
                        "disable_tqdm": True})
    result = RLOOTrainer(cfg).train()
    assert result.global_step == SMOKE_TRAIN["max_steps"]
    assert "rewards/gold_reward/mean" in result.last_metrics and "rewards/reward_model/mean" in result.last_metrics
