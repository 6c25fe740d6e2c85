"""Tests for rloo_engine.data: loading prompt datasets, rendering prompts, extra columns, PromptSampler."""

from __future__ import annotations

import copy
import json

import datasets
import pytest

from rloo_engine.data import (
    DataError,
    PromptSampler,
    extra_columns,
    is_conversational,
    load_prompt_dataset,
    render_prompt,
)

ROWS = [
    {"prompt": "the cat sat", "answer": "mat"},
    {"prompt": "a dog ran", "answer": "tree"},
    {"prompt": "the sun", "answer": "moon"},
]
CHAT = [{"role": "user", "content": "what is a cat"}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- loading


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_loads_each_file_format(tmp_path, suffix):
    path = tmp_path / f"prompts{suffix}"
    ds = datasets.Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        _write_jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".parquet":
        ds.to_parquet(str(path))
    else:
        ds.to_csv(str(path), index=False)
    loaded = load_prompt_dataset(str(path))
    assert loaded["prompt"] == [r["prompt"] for r in ROWS]
    assert loaded["answer"] == [r["answer"] for r in ROWS]


def test_single_file_serves_the_requested_split(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert len(load_prompt_dataset(str(path), split="test")) == 3


def test_loads_save_to_disk_dir_and_picks_split(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_prompt_dataset(str(tmp_path / "single"))["answer"] == ["mat", "tree", "moon"]

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "eval": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_prompt_dataset(str(tmp_path / "dict"), split="eval")) == 1
    with pytest.raises(DataError, match=r"splits \['eval', 'train'\]; dataset_train_split 'nope'"):
        load_prompt_dataset(str(tmp_path / "dict"), split="nope")


def test_loads_dir_of_data_files(tmp_path):
    _write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert load_prompt_dataset(str(tmp_path))["prompt"] == [r["prompt"] for r in ROWS]


def test_loads_conversational_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": CHAT}, {"prompt": CHAT + CHAT}])
    ds = load_prompt_dataset(str(path))
    assert all(is_conversational(p) for p in ds["prompt"])


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"dataset_name: {missing} does not exist"):
        load_prompt_dataset(str(missing))


def test_missing_prompt_column_lists_columns_found(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match=rf"{path}: no 'prompt' column; found columns \['question', 'answer'\]"):
        load_prompt_dataset(str(path))


def test_empty_dataset_is_rejected(tmp_path):
    datasets.Dataset.from_dict({"prompt": []}, features=datasets.Features({"prompt": datasets.Value("string")})).save_to_disk(
        str(tmp_path / "empty")
    )
    with pytest.raises(DataError, match="empty"):
        load_prompt_dataset(str(tmp_path / "empty"))


def test_mixed_prompt_kinds_are_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "text"}, {"prompt": CHAT}])
    with pytest.raises(DataError, match=r"mixes strings \(first at row 0\), message lists \(first at row 1\)"):
        load_prompt_dataset(str(path))


def test_invalid_prompt_names_the_row(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": 5}])
    with pytest.raises(DataError, match="row 1 has prompt 5"):
        load_prompt_dataset(str(path))


def test_column_clashing_with_reward_kwargs_is_rejected(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "completions": "x"}])
    with pytest.raises(DataError, match=r"\['completions'\] clash"):
        load_prompt_dataset(str(path))


# ---------------------------------------------------------------- rendering and columns


def test_is_conversational():
    assert is_conversational(CHAT)
    assert not is_conversational("text")
    assert not is_conversational([])
    assert not is_conversational([{"role": "user"}])


def test_standard_prompt_renders_unchanged(policy_tokenizer):
    assert render_prompt(policy_tokenizer, "the cat sat") == "the cat sat"


def test_conversational_prompt_uses_chat_template(policy_tokenizer):
    text = render_prompt(policy_tokenizer, [{"role": "system", "content": "be brief"}] + CHAT)
    assert text == "<|system|>be brief\n<|user|>what is a cat\n<|assistant|>"


def test_chat_template_kwargs_reach_the_template(policy_tokenizer):
    tok = copy.deepcopy(policy_tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    assert render_prompt(tok, CHAT, {"shout": True}) == "what is a cat!"
    assert render_prompt(tok, CHAT) == "what is a cat"


def test_conversational_prompt_without_chat_template_is_a_clear_error(policy_tokenizer):
    tok = copy.deepcopy(policy_tokenizer)  # the session fixture stays untouched
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        render_prompt(tok, CHAT)


def test_extra_columns_drop_prompt():
    assert extra_columns(ROWS) == {"answer": ["mat", "tree", "moon"]}
    assert extra_columns([]) == {}


# ---------------------------------------------------------------- PromptSampler


def test_sampler_ranks_are_disjoint_and_cover_the_epoch():
    ranks = [PromptSampler(12, seed=3, shuffle=True, rank=r, num_processes=2) for r in range(2)]
    seen = []
    for _ in range(3):
        step = [s.next_indices(2) for s in ranks]
        assert not set(step[0]) & set(step[1])
        seen += step[0] + step[1]
    assert sorted(seen) == list(range(12))
    assert all(s.epoch == 1 for s in ranks)


def test_sampler_is_deterministic_and_shuffles_per_epoch():
    a, b = PromptSampler(10, seed=7, shuffle=True), PromptSampler(10, seed=7, shuffle=True)
    first, second = a.next_indices(10), a.next_indices(10)
    assert b.next_indices(10) == first
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # epoch 1 uses seed + 1
    assert first != PromptSampler(10, seed=8, shuffle=True).next_indices(10)


def test_sampler_without_shuffle_is_in_order_and_crosses_epochs():
    s = PromptSampler(5, seed=0, shuffle=False)
    assert s.next_indices(3) == [0, 1, 2]
    assert s.next_indices(3) == [3, 4, 0]
    assert s.epoch == 1
    assert s.next_indices(12) == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]
    assert s.epoch == 3


def test_sampler_crossing_epoch_continues_into_next_permutation():
    s = PromptSampler(6, seed=1, shuffle=True)
    s.next_indices(4)
    crossing = s.next_indices(4)
    reference = PromptSampler(6, seed=1, shuffle=True)
    order = reference.next_indices(6) + reference.next_indices(6)
    assert crossing == order[4:8]


def test_sampler_state_dict_resumes_identically():
    s = PromptSampler(7, seed=5, shuffle=True, rank=1, num_processes=2)
    s.next_indices(2)
    s.next_indices(2)
    state = s.state_dict()
    expected = [s.next_indices(2) for _ in range(5)]

    resumed = PromptSampler(7, seed=5, shuffle=True, rank=1, num_processes=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
    assert [resumed.next_indices(2) for _ in range(5)] == expected
    assert resumed.epoch == s.epoch


def test_sampler_state_from_other_data_is_rejected():
    state = PromptSampler(7, seed=5, shuffle=True).state_dict()
    with pytest.raises(DataError, match="saved dataset_len=7 but this run has dataset_len=8"):
        PromptSampler(8, seed=5, shuffle=True).load_state_dict(state)
