"""Atomic checkpoints: HF-format model + tokenizer, accelerate state (optimizer, scheduler, RNG), trainer counters.

Layout of `output_dir/checkpoint-N/`:
  config.json, model.safetensors, tokenizer files   -- loadable by AutoModelForCausalLM; under LoRA the
                       adapter in PEFT layout instead (adapter_config.json, adapter_model.safetensors),
                       loadable by PeftModel.from_pretrained(base, path), as `final/` (see `save_final`)
  accelerate/          optimizer, scheduler, per-process RNG states (python, numpy, torch); under DeepSpeed its
                       sharded model and optimizer state, under FSDP2 theirs as torch distributed checkpoints
                       (pytorch_model_fsdp_0/, optimizer_0/: one .distcp file per process and a .metadata)
  trainer_state.json   step counters, data position, metric history tail
  rank{r}.pt           per-process state that differs between ranks (generation buffer)
A checkpoint is written to `.tmp-checkpoint-N`, fsynced, then renamed, so a crash never leaves
a half-written `checkpoint-N` behind. Before a resume loads anything, `validate_checkpoint` reads every
file it needs (a disk or a copy can still damage one), and `latest` falls back to the newest one
that is whole. A save first checks that the disk has room for another checkpoint as large as the last.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import SafetensorError
from safetensors.torch import load_file

from rloo_engine.config_base import ConfigError
from rloo_engine.distributed import unwrapped
from rloo_engine.run.fault_injection import maybe_kill

_CKPT = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, I/O error); the partial directory has been removed."""


# What a failed write raises: OSError; torch's short write is a RuntimeError ("unexpected pos"); safetensors'
# full disk is its own SafetensorError ("No space left on device").
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def _numbered_dirs(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-N` directory in `output_dir`, complete or not, newest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def state_layout(accelerator: Accelerator) -> str:
    """How accelerate writes the training state: "deepspeed" and "fsdp" (sharded, weights included) or "ddp"."""
    return {DistributedType.DEEPSPEED: "deepspeed", DistributedType.FSDP: "fsdp"}.get(accelerator.distributed_type,
                                                                                      "ddp")


def resolve_resume(resume_from_checkpoint: str | None, output_dir: str | Path, num_processes: int = 1,
                   layout: str = "ddp", report: bool = True) -> Path | None:
    """`latest` -> the newest checkpoint that validates, or None (fresh start); a path must validate.

    Each checkpoint `latest` passes over is named on stderr (by rank 0: `report`) with what is wrong with it.
    """
    if not resume_from_checkpoint:
        return None
    if resume_from_checkpoint == "latest":
        for path in _numbered_dirs(output_dir):
            problem = validate_checkpoint(path, num_processes, layout)
            if problem is None:
                return path
            if report:
                print(f"rloo-engine: skipping {path}: {problem}; trying an older checkpoint", file=sys.stderr)
        if report and not _numbered_dirs(output_dir):
            print(f"rloo-engine: no checkpoint in {output_dir} yet; starting from step 0", file=sys.stderr)
        return None  # with unusable ones only, the start check refuses (continuity.check_start)
    path = Path(resume_from_checkpoint)
    if not path.is_dir():
        raise ConfigError(
            f"resume_from_checkpoint: {path} does not exist or is not a directory; expected 'latest' or a "
            "checkpoint-N directory"
        )
    problem = validate_checkpoint(path, num_processes, layout)
    if problem is not None:
        raise ConfigError(
            f"resume_from_checkpoint: {path} cannot be resumed: {problem}; expected a complete checkpoint-N "
            "directory (or 'latest', which falls back to the newest complete one)"
        )
    return path


def validate_checkpoint(path: Path, num_processes: int, layout: str) -> str | None:
    """What is wrong with `path` as a resume point for `num_processes` processes, or None if every file reads.

    Reads what a resume reads: the trainer state, the model weights' safetensors headers against the file
    sizes, the optimizer (or DeepSpeed's or FSDP2's shards), scheduler, every rank's RNG state and rank file.
    Every rank checks every rank's files, so all ranks reach the same verdict.
    """
    state = path / STATE_FILE
    if not state.is_file():
        return f"{STATE_FILE} is missing (the write did not finish)"
    try:
        step = json.loads(state.read_text())["global_step"]
        if not isinstance(step, int):
            raise TypeError(f"global_step is {step!r}")
    except (ValueError, KeyError, TypeError) as err:
        return f"{STATE_FILE} is unreadable ({type(err).__name__}: {err})"
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors model or adapter weights"
    for f in weights:
        if problem := _safetensors_problem(f):
            return f"{f.name} {problem}"
    acc = path / "accelerate"
    if layout == "fsdp":
        for name in ("pytorch_model_fsdp_0", "optimizer_0"):
            if problem := _distcp_problem(acc / name):
                return f"accelerate/{name} {problem}"
        needed = []
    elif layout == "deepspeed":
        shards = acc / "pytorch_model"
        for rank in range(num_processes):
            if not list(shards.glob(f"*zero_pp_rank_{rank}_*")):
                return f"accelerate/pytorch_model has no zero_pp_rank_{rank}_* DeepSpeed state"
        needed = sorted(p for p in shards.glob("*.pt")) if shards.is_dir() else []
    else:
        needed = [acc / "optimizer.bin"]
    needed += sorted(acc.glob("custom_checkpoint_*.pkl"))
    needed += [acc / f"random_states_{r}.pkl" for r in range(num_processes)]
    needed += [path / f"rank{r}.pt" for r in range(num_processes)]
    for f in needed:
        if problem := _torch_file_problem(f):
            rel = f.relative_to(path)
            if f.name.startswith(("rank", "random_states_")) and not f.exists():  # a per-process file
                problem += f"; it was written by a run with fewer processes than this one ({num_processes})"
            return f"{rel} {problem}"
    return None


def _distcp_problem(root: Path) -> str | None:
    """A torch distributed checkpoint: its `.metadata` (written last, by the coordinator) names every file it
    placed tensors in; each must be there, at least as long as the last byte read from it."""
    metadata = root / ".metadata"
    if not metadata.is_file() or metadata.stat().st_size == 0:
        return "has no .metadata (the distributed checkpoint did not finish)"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(root)).read_metadata().storage_data
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError, ValueError) as err:
        return f"has an unreadable .metadata ({type(err).__name__}: {err})"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        f = root / name
        if not f.is_file():
            return f"is missing {name}"
        if f.stat().st_size < end:
            return f"has {name} truncated ({f.stat().st_size} bytes, the metadata reads up to {end})"
    return None


def _safetensors_problem(f: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors the header places."""
    size = f.stat().st_size
    try:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > size - 8:
                raise ValueError(f"header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
    except (struct.error, ValueError) as err:
        return f"has no readable header ({err})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"is truncated (its header places {8 + n + end} bytes, the file has {size})"
    return None


def _torch_file_problem(f: Path) -> str | None:
    """None if `torch.load` would read `f`; zip archives are checked by their central directory, small files loaded."""
    if not f.is_file():
        return "is missing"
    if f.stat().st_size == 0:
        return "is empty (0 bytes)"
    try:
        if f.stat().st_size > 16 * 2**20 and zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as archive:
                archive.infolist()
        else:
            torch.load(f, map_location="cpu", weights_only=False)
    except (zipfile.BadZipFile, RuntimeError, EOFError, pickle.UnpicklingError, OSError, ValueError) as err:
        return f"is unreadable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return None


def remove_partial_writes(output_dir: str | Path) -> list[Path]:
    """Deletes `.tmp-*` directories a killed run left (call with the output_dir lock held); returns them."""
    root = Path(output_dir)
    doomed = [p for p in root.glob(".tmp-*") if p.is_dir()] if root.is_dir() else []
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _space_problem(root: Path, step: int) -> str | None:
    """Room for a checkpoint as large as the last one? (No earlier checkpoint: nothing to measure by.)"""
    previous = checkpoint_dirs(root)
    if not previous:
        return None
    need, free = _tree_bytes(previous[-1]), shutil.disk_usage(root).free
    if free >= need:
        return None
    return (f"checkpoint-{step}: {root} has {free} bytes free, the last checkpoint took {need} "
            f"({previous[-1].name}); free space or lower save_total_limit, then resume")


def install_state_hooks(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Keep model weights out of the accelerate state: they are saved once, in HF format, beside it.

    DeepSpeed and FSDP2 shard weights with the optimizer, so there accelerate keeps saving them itself.
    """
    if state_layout(accelerator) != "ddp":
        return

    def skip_weights(models, weights, output_dir):
        weights.clear()

    def load_hf_weights(models, input_dir):
        models.clear()
        load_model_weights(unwrapped(accelerator, model), Path(input_dir).parent)

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
    if unexpected and hasattr(model, "config"):
        # transformers 5 writes some layouts converted (a MoE layer's experts, one fused tensor in memory, one tensor
        # per expert on disk, as the released checkpoints have them): its own loader converts them back.
        dtype = next(model.parameters()).dtype
        state = type(model).from_pretrained(ckpt_dir, dtype=dtype).state_dict()
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {k for k in missing if "lm_head" in k or "embed" in k}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"{ckpt_dir}: weights do not match the model (missing {missing}, unexpected {unexpected})")
    model.tie_weights()


# Runs whose models are whole on every process: `get_state_dict` is then the unwrapped model's `state_dict()`.
_PLAIN = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


def full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0 (collective: every process must call it), tied copies dropped.

    DeepSpeed hands back clones, so tied weights (lm_head = embed_tokens) no longer share storage and
    `save_pretrained` would write the embedding twice; the model's own parameter aliasing says which go.
    """
    if accelerator.distributed_type in _PLAIN:  # accelerate's branch for these, without its DeepSpeed import
        state_dict = unwrapped(accelerator, model).state_dict()
    else:
        state_dict = accelerator.get_state_dict(model) or {}  # ZeRO-3 returns None off rank 0
    for name in _tied_aliases(unwrapped(accelerator, model)):
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
    """Writes `output_dir/checkpoint-{step}` atomically; every process must call it.

    Refused (CheckpointWriteError, on every rank) when the disk has less room than the last checkpoint
    took; a write that fails anyway removes its `.tmp-checkpoint-N` so it does not keep the disk full.
    """
    root = Path(output_dir)
    final, tmp = root / f"checkpoint-{step}", root / f".tmp-checkpoint-{step}"
    problem = _space_problem(root, step) if accelerator.is_main_process else None
    if _any_rank(accelerator, problem is not None):
        raise CheckpointWriteError(problem or f"checkpoint-{step}: rank 0 found too little free space in {root}")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    error = None
    try:
        accelerator.save_state(str(tmp / "accelerate"))
        torch.save(rank_state, tmp / f"rank{accelerator.process_index}.pt")
        maybe_kill(step, "checkpoint-partial")
    except WRITE_ERRORS as err:
        error = err
    # The gather below is collective, so a rank that failed still joins it.
    state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process and error is None:
        try:
            unwrapped(accelerator, model).save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=1))
            _fsync_tree(tmp)
        except WRITE_ERRORS as err:
            error = err
    if _any_rank(accelerator, error is not None):
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root).free if root.is_dir() else 0
        cause = f"{type(error).__name__}: {error}" if error else "another rank failed"
        raise CheckpointWriteError(f"checkpoint-{step}: writing {tmp} failed ({cause}); {free} bytes free on "
                                   f"{root}; the partial checkpoint was removed") from error
    if accelerator.is_main_process:
        maybe_kill(step, "checkpoint-written")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_tree(root)
        prune_checkpoints(root, save_total_limit)
    accelerator.wait_for_everyone()
    return final


def _any_rank(accelerator: Accelerator, flag: bool) -> bool:
    """True on every rank if `flag` is True on any (collective)."""
    if accelerator.num_processes == 1:
        return flag
    flags = accelerator.gather(torch.tensor([int(flag)], device=accelerator.device))
    return bool(flags.sum().item())


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
    """Restores model, optimizer, scheduler and RNG in place; returns (trainer_state, this rank's state).

    `path` must have passed `validate_checkpoint`: accelerate itself only logs (at INFO) an RNG state it cannot read.
    """
    accelerator.load_state(str(path / "accelerate"))
    trainer_state = json.loads((path / STATE_FILE).read_text())
    rank_file = path / f"rank{accelerator.process_index}.pt"
    return trainer_state, torch.load(rank_file, weights_only=False)


MERGED_DIR = "final-merged"  # a LoRA run's adapters merged into the base, with `save_merged_model`


def save_final(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer, output_dir: str | Path,
    fresh_policy: Callable[[], torch.nn.Module], save_merged: bool = False,
) -> Path:
    """Writes `output_dir/final` in HF format; every process must call it. Returns its path.

    A full-weight run's `final/` is a plain causal LM. A LoRA run's is the adapter in PEFT layout
    (adapter_config.json, adapter_model.safetensors, the tokenizer), as TRL saves it: loadable with
    `PeftModel.from_pretrained(base, final)`. With `save_merged` the adapters are also merged into a whole
    copy of the base, written to `final-merged/`; without it a `final-merged/` an earlier run left is
    removed, so it never disagrees with `final/`.

    The weights come from `full_state_dict`, which gathers ZeRO-3 shards onto rank 0. The merge happens
    in `fresh_policy()` (a whole, unsharded copy of the base with the same adapters): a ZeRO-3 model's own
    parameters are empty shards.
    """
    root = Path(output_dir)
    accelerator.wait_for_everyone()
    state_dict = full_state_dict(accelerator, model)
    error = None
    if accelerator.is_main_process:
        inner = unwrapped(accelerator, model)
        try:
            # A PeftModel given the whole state dict keeps only the adapter's entries.
            _write_model_dir(root / "final", inner, state_dict, tokenizer)
            merged_dir = root / MERGED_DIR
            if hasattr(inner, "peft_config") and save_merged:
                merged = fresh_policy()
                missing, unexpected = merged.load_state_dict(state_dict, strict=False)
                if unexpected or set(missing) - _tied_aliases(merged):
                    raise RuntimeError(f"{MERGED_DIR}: gathered weights do not fit a fresh policy (missing "
                                       f"{missing}, unexpected {unexpected})")
                _write_model_dir(merged_dir, merged.merge_and_unload(), None, tokenizer)
            else:
                shutil.rmtree(merged_dir, ignore_errors=True)
        except WRITE_ERRORS as err:
            error = err
    if _any_rank(accelerator, error is not None):
        raise CheckpointWriteError(_final_failed(root, error)) from error
    accelerator.wait_for_everyone()
    return root / "final"


def _final_failed(root: Path, error: BaseException | None) -> str:
    """What a failed `final/` write says: why, the space left, and what of the run is still on disk."""
    for partial in (root / ".tmp-final", root / f".tmp-{MERGED_DIR}"):
        shutil.rmtree(partial, ignore_errors=True)
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    kept = next((p for p in _numbered_dirs(root) if (p / STATE_FILE).is_file()), None)
    cause = f"{type(error).__name__}: {error}" if error else "rank 0 failed"
    then = (f"the newest checkpoint, {kept}, is kept: free space and run again with --resume_from_checkpoint latest "
            "to write final/ from it" if kept else "no checkpoint was kept (save_steps), so the trained weights are "
            "lost; give the run a disk with room for checkpoints and final/")
    return f"final: writing {root / 'final'} failed ({cause}); {free} bytes free on {root}; the partial write was " \
           f"removed; {then}"


def save_model_files(accelerator: Accelerator, model: torch.nn.Module, tokenizer, target: str | Path) -> None:
    """TRL's `save_model`: the model (a LoRA run: its adapter) and tokenizer written into `target`, beside
    whatever it holds (it may be the run's output_dir, with its checkpoints); every process must call it."""
    accelerator.wait_for_everyone()
    state_dict = full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        Path(target).mkdir(parents=True, exist_ok=True)
        unwrapped(accelerator, model).save_pretrained(target, state_dict=state_dict)
        tokenizer.save_pretrained(target)
    accelerator.wait_for_everyone()


def _write_model_dir(target: Path, model: torch.nn.Module, state_dict: dict | None, tokenizer) -> None:
    """`save_pretrained` into `.tmp-<name>`, fsynced, then renamed over `target`: never half a model."""
    tmp = target.with_name(f".tmp-{target.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    _fsync_tree(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
