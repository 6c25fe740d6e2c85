"""Atomic checkpoints: HF-format model + tokenizer, accelerate state (optimizer, scheduler, RNG), trainer counters.

Layout of `output_dir/checkpoint-N/`:
  config.json, model.safetensors (or adapter_*), tokenizer files   -- loadable by AutoModelForCausalLM
  accelerate/          optimizer, scheduler, per-process RNG states (python, numpy, torch)
  trainer_state.json   step counters, data position, metric history tail
  rank{r}.pt           per-process state that differs between ranks (generation buffer)
A checkpoint is written to `.tmp-checkpoint-N`, fsynced, then renamed, so a crash never leaves
a half-written `checkpoint-N` behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from rloo_engine.config import ConfigError

_CKPT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str | Path) -> Path | None:
    """`latest` -> newest checkpoint or None (fresh start); a path must be a complete checkpoint."""
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        dirs = checkpoint_dirs(output_dir)
        return dirs[-1] if dirs else None
    path = Path(resume_from_checkpoint)
    if not (path / STATE_FILE).is_file():
        raise ConfigError(
            f"resume_from_checkpoint: {path} is not a complete checkpoint (no {STATE_FILE}); "
            "expected 'latest' or a checkpoint-N directory"
        )
    return path


def install_state_hooks(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Keep model weights out of the accelerate state: they are saved once, in HF format, beside it.

    DeepSpeed shards weights with the optimizer, so there accelerate keeps saving them itself.
    """
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return

    def skip_weights(models, weights, output_dir):
        weights.clear()

    def load_hf_weights(models, input_dir):
        models.clear()
        load_model_weights(accelerator.unwrap_model(model), Path(input_dir).parent)

    accelerator.register_save_state_pre_hook(skip_weights)
    accelerator.register_load_state_pre_hook(load_hf_weights)


def load_model_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Loads weights written by `save_pretrained` (full model or LoRA adapter) into `model` in place."""
    if hasattr(model, "peft_config"):
        from peft import load_peft_weights, set_peft_model_state_dict

        set_peft_model_state_dict(model, load_peft_weights(str(ckpt_dir)))
        return
    state: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt_dir.glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{ckpt_dir}: weights do not match the model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (collective: every process must call it), tied copies dropped.

    DeepSpeed hands back clones, so tied weights (lm_head = embed_tokens) no longer share storage and
    `save_pretrained` would write the embedding twice; the model's own parameter aliasing says which go.
    """
    state_dict = accelerator.get_state_dict(model) or {}  # ZeRO-3 returns None off rank 0
    for name in _tied_aliases(accelerator.unwrap_model(model)):
        state_dict.pop(name, None)
    return state_dict


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are another parameter under a second name (e.g. a tied lm_head)."""
    seen: set[int] = set()
    aliases = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer,
    output_dir: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    save_total_limit: int | None,
) -> Path:
    """Writes `output_dir/checkpoint-{step}` atomically; every process must call it."""
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / "accelerate"))
    torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
    state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_tree(root)
        prune_checkpoints(root, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def prune_checkpoints(output_dir: Path, save_total_limit: int | None) -> list[Path]:
    """Deletes the oldest checkpoints beyond `save_total_limit`; returns what was deleted."""
    if not save_total_limit:
        return []
    dirs = checkpoint_dirs(output_dir)
    doomed = dirs[: max(0, len(dirs) - save_total_limit)]
    for d in doomed:
        shutil.rmtree(d)
    return doomed


def load_checkpoint(accelerator: Accelerator, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restores model, optimizer, scheduler and RNG in place; returns (trainer_state, this rank's state)."""
    accelerator.load_state(str(path / "accelerate"))
    trainer_state = json.loads((path / STATE_FILE).read_text())
    rank_file = path / f"rank{accelerator.process_index}.pt"
    if not rank_file.is_file():
        raise ConfigError(
            f"resume_from_checkpoint: {path} has no {rank_file.name}; it was written by a run with fewer "
            f"processes than this one ({accelerator.num_processes})"
        )
    return trainer_state, torch.load(rank_file, weights_only=False)


def save_final(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: str | Path,
    fresh_policy: Callable[[], torch.nn.Module],
) -> Path:
    """Writes `output_dir/final` in HF format, loadable as a plain causal LM; every process must call it.

    The weights come from `full_state_dict`, which gathers ZeRO-3 shards onto rank 0.
    Under LoRA they are loaded into `fresh_policy()` (a whole, unsharded copy of the base with the
    same adapters) and the adapters merged there: a ZeRO-3 model's own parameters are empty shards.
    """
    final = Path(output_dir) / "final"
    accelerator.wait_for_everyone()
    state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if hasattr(unwrapped, "peft_config"):
            merged = fresh_policy()
            missing, unexpected = merged.load_state_dict(state_dict, strict=False)
            if unexpected or set(missing) - _tied_aliases(merged):
                raise RuntimeError(f"final: gathered weights do not fit a fresh policy (missing {missing}, "
                                   f"unexpected {unexpected})")
            unwrapped, state_dict = merged.merge_and_unload(), None
        tmp = final.with_name(".tmp-final")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final
