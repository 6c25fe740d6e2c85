"""Builds the offline demo's assets once (tokenizer, SFT policy, reward model, prompt files) and caches them.

    assets = build_demo_assets(Path(".rloo-demo/assets"))     # about two minutes the first time
    assets.sft_dir, assets.reward_model_dir, assets.train_prompts, assets.eval_prompts, assets.summary

The assets are keyed by a hash of their settings, the seed, ASSET_VERSION and the source of the
demo modules; a directory whose manifest.json holds the same key is reused as it is. A build
writes into a temporary sibling directory and renames it into place only when it is complete, so
an interrupted build never leaves a directory that looks finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rloo_engine.demo import toy_task
from rloo_engine.demo.settings import DEMO_ASSETS, SMOKE_ASSETS, AssetSettings
from rloo_engine.progress import progress_bar

ASSET_VERSION = 1  # bump to rebuild every cached asset directory
MANIFEST = "manifest.json"
_SOURCES = ("toy_task.py", "sft.py", "reward_model_training.py", "assets.py")


@dataclasses.dataclass(frozen=True)
class DemoAssets:
    """Paths of one built asset directory, and what the build measured."""

    root: Path
    sft_dir: Path  # causal LM + tokenizer, save_pretrained format
    reward_model_dir: Path  # AutoModelForSequenceClassification, num_labels=1, same tokenizer
    train_prompts: Path  # jsonl: {"prompt"}
    eval_prompts: Path  # jsonl: {"prompt", "reference"}, prompts never seen in training
    summary: dict[str, Any]  # sft_first_loss, sft_final_loss, rm_heldout_accuracy, build_seconds, ...
    from_cache: bool = False


def asset_key(settings: AssetSettings, seed: int) -> str:
    """Hash of everything that decides the assets' content."""
    here = Path(__file__).parent
    sources = hashlib.sha256(b"".join((here / name).read_bytes() for name in _SOURCES)).hexdigest()
    blob = json.dumps(
        {"version": ASSET_VERSION, "settings": dataclasses.asdict(settings), "seed": seed, "sources": sources},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_demo_assets(root: str | Path, smoke: bool = False, seed: int = 0, progress: bool = True,
                      settings: AssetSettings | None = None) -> DemoAssets:
    """The demo's assets under `root`: reused when `root/manifest.json` has the same key, else built (atomically).

    `smoke` selects SMOKE_ASSETS (seconds, for CI) instead of DEMO_ASSETS; `settings` overrides both.
    `root` must be absent, empty, or a previous asset directory (it is replaced when its key differs).
    """
    root = Path(root)
    settings = settings or (SMOKE_ASSETS if smoke else DEMO_ASSETS)
    key = asset_key(settings, seed)
    cached = load_demo_assets(root)
    if cached is not None and cached.summary.get("key") == key:
        return cached
    if root.exists() and any(root.iterdir()) and cached is None:
        raise FileExistsError(
            f"root: {root} exists, is not empty and has no {MANIFEST}; expected an absent or empty directory, "
            "or one written by build_demo_assets (it is not overwritten otherwise)"
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = root.parent / f".{root.name}.building-{uuid.uuid4().hex[:8]}"
    try:
        _build(staging, settings, seed, key, progress)
        _replace_dir(staging, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    built = load_demo_assets(root)
    assert built is not None, f"{root}/{MANIFEST} missing right after the build wrote it"
    return dataclasses.replace(built, from_cache=False)


def load_demo_assets(root: str | Path) -> DemoAssets | None:
    """The assets described by `root/manifest.json`, or None when there is no complete build there."""
    root = Path(root)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    paths = manifest["paths"]
    return DemoAssets(
        root=root,
        sft_dir=root / paths["sft_dir"],
        reward_model_dir=root / paths["reward_model_dir"],
        train_prompts=root / paths["train_prompts"],
        eval_prompts=root / paths["eval_prompts"],
        summary={"key": manifest["key"], **manifest["summary"]},
        from_cache=True,
    )


# ---------------------------------------------------------------- the build


def _build(out: Path, s: AssetSettings, seed: int, key: str, progress: bool) -> None:
    from rloo_engine.demo.reward_model_training import preference_pairs, train_reward_model
    from rloo_engine.demo.sft import train_sft
    from rloo_engine.testing.tiny_models import train_tokenizer

    start = time.perf_counter()
    out.mkdir(parents=True)
    rng = random.Random(seed)
    train_specs, eval_specs = toy_task.prompt_specs(seed, s.eval_fraction)
    stages = progress_bar(total=4, desc="demo assets", unit="stage", disable=not progress, dynamic_ncols=True)
    with _quiet_transformers(), _one_torch_thread():
        stages.set_postfix_str("data and tokenizer")
        examples = [(p, toy_task.sft_completion(rng, p)) for p in (toy_task.sample_prompt(rng, train_specs)
                                                                 for _ in range(s.sft_examples))]
        references = [(p, toy_task.reference_completion(rng, p)) for p in map(toy_task.make_prompt, eval_specs)]
        tokenizer = train_tokenizer([p + c for p, c in examples + references], vocab_size=s.vocab_size,
                                    chat_template=None)
        stages.update()

        stages.set_postfix_str("SFT policy")
        sft = train_sft(out / "sft", tokenizer, examples, hidden=s.hidden, layers=s.layers, steps=s.sft_steps,
                        batch_size=s.sft_batch_size, learning_rate=s.sft_learning_rate, seed=seed, progress=progress)
        stages.update()

        stages.set_postfix_str("reward model")
        pair_rng = random.Random(seed + 1)
        rm = train_reward_model(
            out / "reward_model", sft.path, tokenizer,
            preference_pairs(pair_rng, train_specs, s.rm_steps * s.rm_batch_size, s.rm_edit_fraction),
            preference_pairs(pair_rng, train_specs, s.rm_heldout_pairs, s.rm_edit_fraction),
            steps=s.rm_steps, batch_size=s.rm_batch_size, learning_rate=s.rm_learning_rate, seed=seed,
            progress=progress,
        )
        stages.update()

        stages.set_postfix_str("prompt files")
        train_prompts = [toy_task.make_prompt(spec) for spec in train_specs]
        _write_jsonl(out / "train_prompts.jsonl", [{"prompt": p} for p in train_prompts])
        eval_rows = [{"prompt": p, "reference": r} for p, r in references[: s.eval_prompts]]
        _write_jsonl(out / "eval_prompts.jsonl", eval_rows)
        stages.update()
    stages.close()

    summary = {
        "sft_first_loss": round(sft.first_loss, 4),
        "sft_final_loss": round(sft.final_loss, 4),
        "rm_first_loss": round(_mean(rm.losses[:10]), 4),
        "rm_final_loss": round(_mean(rm.losses[-10:]), 4),
        "rm_heldout_accuracy": round(rm.heldout_accuracy, 4),
        "policy_parameters": sft.num_parameters,
        "num_train_prompts": len(train_prompts),
        "num_eval_prompts": len(eval_rows),
        "reference_gold_mean": round(_mean([toy_task.gold_score(r["prompt"], r["reference"]) for r in eval_rows]), 4),
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    manifest = {
        "version": ASSET_VERSION,
        "key": key,
        "seed": seed,
        "settings": dataclasses.asdict(s),
        "paths": {"sft_dir": "sft", "reward_model_dir": "reward_model", "train_prompts": "train_prompts.jsonl",
                  "eval_prompts": "eval_prompts.jsonl"},
        "summary": summary,
    }
    # Written last: its presence is what marks the directory complete.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _replace_dir(staging: Path, root: Path) -> None:
    """Puts the finished `staging` at `root`, moving a previous build (if any) aside and deleting it."""
    previous = None
    if root.exists():
        previous = root.parent / f".{root.name}.old-{uuid.uuid4().hex[:8]}"
        root.rename(previous)
    staging.rename(root)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hides transformers' per-file save/load bars while the build shows its own."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Runs the build on one intra-op thread: faster for models this small, and far faster when other
    processes share the cores (measured on 2 busy cores: 95 s on one thread, 570 s on two)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
