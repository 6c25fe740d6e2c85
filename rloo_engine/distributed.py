"""The process group and launch profile: builds the Accelerator, refuses a profile it cannot honour, prepares frozen models.

The launch profile (`accelerate launch --config_file ...`) reaches the engine as environment
variables. accelerate 1.15 has two traps on machines without CUDA, both handled here:
- `Accelerator(cpu=True)` silently turns a DeepSpeed profile into plain DDP (`MULTI_CPU`);
- without `cpu=True` it finds no process-group backend, so every rank reports `process_index 0`
  and `num_processes 1` even though DeepSpeed has formed a real gloo group.
So under DeepSpeed without an accelerator we pass `backend="gloo"` explicitly, and we check that
accelerate's view of the ranks matches torch.distributed before any work starts.

FSDP2 (`fsdp_version: 2`) has a third: accelerate selects FSDP only for GPU-like backends, so on a machine without
an accelerator an FSDP profile would run as plain DDP. There the engine selects it itself, with the plugin accelerate
builds from the same profile, and everything after (`prepare`'s `fully_shard`, distributed checkpoints, the full
state dict) is accelerate's own FSDP2 path, as on a GPU node.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError


class LaunchError(ConfigError):
    """The launch profile cannot run as asked; the message names the profile and what to change."""


def end_process_group(after_error: bool = False) -> None:
    """Destroys the default process group, if one was formed. The process must do this before it exits: left
    to interpreter teardown, gloo's worker threads now and then outlive it and abort the process ("terminate
    called without an active exception", SIGABRT), so a finished run or a clean error exit became a crash.
    `after_error`: only a gloo group, since this rank may have failed alone while the others wait in a
    collective, and tearing down NCCL communicators is itself a collective call in some NCCL versions."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if after_error and torch.distributed.get_backend() != "gloo":
        return
    # `destroy_process_group` drops only torch.distributed's own references. The trainer sits in reference cycles,
    # so its DDP model, which holds the group and its last works, would otherwise live until interpreter teardown,
    # where freeing them aborts the process the same way (a 2-rank DDP script: 4 of 12 exits; collected first:
    # 0 of 16). So the cycles go first, while the interpreter is whole.
    gc.collect()
    torch.distributed.destroy_process_group()


def requested_profile() -> str:
    """What the launcher asked for, from accelerate's environment: `deepspeed-zero<N>`, `fsdp<version>` or `ddp`."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return f"deepspeed-zero{os.environ.get('ACCELERATE_DEEPSPEED_ZERO_STAGE', '2')}"
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return f"fsdp{os.environ.get('FSDP_VERSION', '1')}"  # accelerate's own default version is 1
    return "ddp"


def build_accelerator(cfg: RLOOConfig) -> Accelerator:
    """The Accelerator for this launch; raises LaunchError rather than run another profile than asked."""
    profile = requested_profile()
    has_device = torch.accelerator.is_available()
    precision = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "no"
    kwargs = dict(gradient_accumulation_steps=cfg.gradient_accumulation_steps, mixed_precision=precision)
    if profile.startswith("fsdp") and profile != "fsdp2":
        raise LaunchError(f"launch profile {profile}: FSDP{profile[4:]} is not supported by rloo-engine; set "
                          "fsdp_config.fsdp_version: 2 (deployments/accelerate/fsdp2.yaml) or use a deepspeed_zero2/3 "
                          "profile")
    if profile == "fsdp2" and not has_device and os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise LaunchError("launch profile fsdp2: fsdp_offload_params: true needs a GPU (torch's FSDP2 CPU offload "
                          "stages through an accelerator: 'Cannot access accelerator device when none is available'); "
                          "set it to false on a machine without one")
    if profile == "fsdp2" and not has_device:
        acc = Accelerator(**kwargs, cpu=True)  # a gloo group; accelerate itself would run it as MULTI_CPU (DDP)
        select_fsdp2(acc)
    elif profile.startswith("deepspeed"):
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise LaunchError(f"launch profile {profile}: deepspeed is not installed; "
                              "pip install 'rloo-pipeline[deepspeed]'") from None
        if not has_device:
            if cfg.fp16:
                raise LaunchError(f"launch profile {profile}: fp16 needs a GPU (DeepSpeed's CPU accelerator has no "
                                  "fp16 loss scaling); use bf16: true or a GPU node")
            # Without a device accelerate finds no backend and reports one process per rank; gloo fixes both.
            kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
            from rloo_engine.torch_extensions import clear_stale_lock

            clear_stale_lock()  # each rank, before it waits on the lock itself (a rank's wait would never end)
        acc = Accelerator(**kwargs)
    else:
        # Without an accelerator, `cpu=True` lets a torchrun-style launch form a gloo process group (MULTI_CPU).
        acc = Accelerator(**kwargs, cpu=not has_device)
    check_launch(acc, profile)
    return acc


def select_fsdp2(acc: Accelerator) -> None:
    """Makes a CPU process group run accelerate's FSDP2 path: the plugin from the profile's FSDP_* variables (as
    accelerate builds it on a GPU node) and the distributed type accelerate's own FSDP branch would set."""
    if not torch.distributed.is_initialized():
        raise LaunchError("launch profile fsdp2: no process group was formed; launch with `accelerate launch "
                          "--config_file deployments/accelerate/fsdp2.yaml --num_processes N ...`")
    plugin = FullyShardedDataParallelPlugin()
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState's init records it


def check_launch(acc: Accelerator, profile: str) -> None:
    """Fails when accelerate's ranks disagree with torch.distributed, or when it runs another profile."""
    expected = (DistributedType.DEEPSPEED if profile.startswith("deepspeed") else
                DistributedType.FSDP if profile == "fsdp2" else None)
    if expected is not None and acc.distributed_type != expected:
        raise LaunchError(f"launch profile {profile}: accelerate set up {acc.distributed_type.value} instead of "
                          f"{expected.value}; refusing to train under a different profile than the one launched")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if (acc.num_processes, acc.process_index) != (world, rank):
            raise LaunchError(
                f"launch profile {profile}: accelerate reports process {acc.process_index} of {acc.num_processes}, "
                f"torch.distributed rank {rank} of {world}; every rank would act as the main process"
            )
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise LaunchError(f"launch profile {profile}: WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group "
                          "was formed; launch with `accelerate launch --multi_gpu` or a deepspeed profile")


def is_deepspeed(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.DEEPSPEED


def is_fsdp2(acc: Accelerator) -> bool:
    return acc.distributed_type == DistributedType.FSDP


def is_shard(tensor: torch.Tensor) -> bool:
    """An FSDP2 parameter: a DTensor, of which this rank holds its shard (`to_local`) and the whole is a collective
    (`full_tensor`)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def unwrapped(acc: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """`acc.unwrap_model(model)`, without importing DeepSpeed into a run that does not use it. Accelerate's unwrap
    imports DeepSpeed whenever it is installed, and DeepSpeed imports MLflow: ~50 MiB of resident memory and ~1 s
    (bench/README.md, round 3). A model can only be a DeepSpeed engine once DeepSpeed is imported, so until then
    only the wrapper a run without it puts on (DDP) is taken off here. transformers' `save_pretrained` still imports
    it (its own unwrap): a run without DeepSpeed pays it at its first checkpoint or final save, not at start-up."""
    if "deepspeed" in sys.modules or is_deepspeed(acc):
        return acc.unwrap_model(model)
    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    return model


def zero_stage(acc: Accelerator) -> int:
    """DeepSpeed's ZeRO stage (0 when not under DeepSpeed)."""
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage or 0) if is_deepspeed(acc) and plugin is not None else 0


_DS_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def fill_deepspeed_config(acc: Accelerator, cfg: RLOOConfig) -> None:
    """Fills DeepSpeed's batch settings from the engine config (before `prepare`), so `auto` profiles start as they are.

    The engine feeds micro-batches itself (no DataLoader goes through `prepare`), so accelerate cannot
    infer them. A value set explicitly in a DeepSpeed config file must agree with the engine's.
    """
    if not is_deepspeed(acc):
        return
    ds = acc.state.deepspeed_plugin.deepspeed_config
    wanted = {
        "train_micro_batch_size_per_gpu": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "gradient_clipping": float(cfg.max_grad_norm or 0.0),
    }
    for key in _DS_BATCH_KEYS:
        value = ds.get(key, "auto")
        if value == "auto":
            ds[key] = wanted[key]
        elif float(value) != float(wanted[key]):
            field = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
                     "gradient_clipping": "max_grad_norm"}.get(key, key)
            raise LaunchError(f"deepspeed config: {key}={value} disagrees with {field}={wanted[key]}; "
                              f"set it to 'auto' in the DeepSpeed config (the engine fills it)")
    ds["train_batch_size"] = (cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                              * acc.num_processes)
    if ds["zero_optimization"].get("stage") == 3:
        # HF-format checkpoints and `final/` need the full weights gathered on save.
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True


def loads_weights(acc: Accelerator) -> bool:
    """Whether this process reads model weights from their checkpoints. Not under FSDP2 with the profile's
    `fsdp_cpu_ram_efficient_loading` on a process other than the main one: accelerate sends it its shards from the
    main process's copy as it shards each model (`fsdp2_prepare_model`), so it builds them empty
    (`models.empty_model`)."""
    return not (is_fsdp2(acc) and acc.state.fsdp_plugin.cpu_ram_efficient_loading and not acc.is_main_process)


def prepare_frozen_model(acc: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A no-grad model (reference or reward) placed for this launch; returns the module to call.

    Under ZeRO-3 it becomes a DeepSpeed inference engine (stage 3, no optimizer): it was partitioned
    as it loaded (zero.Init), and the engine gathers each layer's shards for its forward, so a frozen
    model that does not fit one GPU still works. Under ZeRO-2 (stage 0 inference) it is kept whole on
    each device, cast to the training precision, as TRL does. Elsewhere it is just moved to the device.
    Under FSDP2 it is sharded as the policy is (`fully_shard` per decoder layer, the profile's plugin), so it costs
    each process 1/N of its weights, as under ZeRO-3, and each forward all-gathers a layer at a time; with the same
    wrapping as the policy, a reference's shards line up with the policy's (see `gathered_for_update`).
    Every rank must call its forward the same number of times under ZeRO-3 and FSDP2 (the gathers are collective).
    """
    model.requires_grad_(False)
    if is_fsdp2(acc):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        if not any(p.is_meta for p in model.parameters()):  # an empty model gets its shards here
            model = model.to(acc.device)
        model = fsdp2_prepare_model(acc, model)  # not registered with acc: checkpoints skip it
        # Every group, the root and accelerate's tail group (final norm and head) too, which it keeps unsharded
        # after forward for the backward that follows; a frozen model has none, so they would stay whole.
        model.set_reshard_after_forward(True)
        return model.eval()
    if not is_deepspeed(acc):
        return model.to(acc.device).eval()
    import deepspeed

    ds = copy.deepcopy(acc.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        ds.pop(key, None)
    if ds["zero_optimization"]["stage"] != 3:
        ds["zero_optimization"] = {"stage": 0}
    else:
        hidden = getattr(model.config, "hidden_size", None)
        if hidden:
            ds["zero_optimization"].update({
                "reduce_bucket_size": hidden * hidden,
                "stage3_param_persistence_threshold": 10 * hidden,
                "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            })
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    engine.eval()
    return engine  # forwards attribute access (config, score, ...) to its module


def full_weights_for_generation(acc: Accelerator, model: torch.nn.Module):
    """Context in which the prepared policy's full weights exist on every rank, for sampling; a no-op off ZeRO-3.

    Under ZeRO-3 the shards are gathered once and the engine's per-layer hooks are detached for the
    duration: left in place, they re-partition each layer after its forward, so every decoding step
    would all-gather again and ranks that stop generating at different lengths would deadlock.
    deepspeed is imported only on that path, so it stays an optional extra.

    Under FSDP2 every sharded module is unsharded once (one all-gather each) and kept so while the context lasts:
    its forwards then run on the full weights without a collective, and a module's own weight attributes are the
    full tensors (the fused decoder reads them).
    """
    if is_fsdp2(acc):
        return _fsdp2_unsharded(acc, model)
    if zero_stage(acc) != 3:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    return unwrap_model_for_generation(model)


@contextlib.contextmanager
def _fsdp2_unsharded(acc: Accelerator, model: torch.nn.Module):
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    model.set_reshard_after_forward(False)  # a forward would otherwise reshard its module, and the next re-gather
    for module in sharded:
        module.unshard()
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
        # Back to the settings accelerate's prepare made: the profile's, but the root and the tail group (final norm
        # and head, where the backward starts) stay unsharded after forward, sparing a re-gather in every backward.
        model.set_reshard_after_forward(bool(acc.state.fsdp_plugin.reshard_after_forward))
        model.set_reshard_after_forward(False, recurse=False)
        head = unwrapped(acc, model).get_output_embeddings()
        if isinstance(head, FSDPModule):
            head.set_reshard_after_forward(False, recurse=False)


def weights_for_sync(acc: Accelerator, model: torch.nn.Module):
    """Context in which the prepared policy's weights can be read for a generation engine (`vllm_weight_items`).

    Under FSDP2 nothing is gathered here: the state dict holds DTensor shards, and the engine's sync gathers one
    parameter at a time as it loads or sends it (`full_tensor`, a collective, every rank in the same order), so no
    rank ever holds more than one full parameter beyond its shards. Elsewhere: `full_weights_for_generation`.
    """
    if is_fsdp2(acc):
        _reshard(model)
        return contextlib.nullcontext()
    return full_weights_for_generation(acc, model)


def _reshard(*models: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def gathered_for_update(acc: Accelerator, source: torch.nn.Module, target: torch.nn.Module):
    """Context in which `target`'s full weights may be changed from `source`'s (reference sync); a no-op off ZeRO-3.

    Under ZeRO-3 both are gathered on every rank; each rank computes the same update, and rank 0's
    result is re-partitioned into `target`'s shards on exit. Under FSDP2 nothing is gathered: both models are
    sharded by the same plan (`prepare_frozen_model`), so each rank's shard of a reference parameter holds the same
    elements as its shard of the policy's, and the elementwise update runs on the shards.
    """
    if is_fsdp2(acc):
        _reshard(source, target)  # parameters() must be the shards (an unsharded root lists its full tensors)
        yield
        return
    if zero_stage(acc) != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(source.parameters())), \
            deepspeed.zero.GatheredParameters(list(target.parameters()), modifier_rank=0):
        yield


@contextlib.contextmanager
def outside_zero_init(acc: Accelerator):
    """Context in which `from_pretrained` loads whole weights even under ZeRO-3 (no zero.Init partitioning).

    transformers partitions at load time whenever its global DeepSpeed config says stage 3; accelerate's
    own `zero3_init_context_manager` leaves that global set, so it is cleared and restored here.
    """
    if zero_stage(acc) != 3:
        yield
        return
    from transformers.integrations import deepspeed as hf_ds

    previous = hf_ds._hf_deepspeed_config_weak_ref
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = previous


def global_grad_norm(acc: Accelerator, model: torch.nn.Module, max_norm: float | None) -> float | None:
    """Clips gradients (outside DeepSpeed) and returns the global pre-clip norm, as TRL logs `grad_norm`.

    DeepSpeed clips inside its engine step (`gradient_clipping`) and keeps the norm it computed.
    """
    if is_deepspeed(acc):
        norm = model.get_global_grad_norm()
        return None if norm is None else float(norm)
    if not max_norm:
        return None
    norm = acc.clip_grad_norm_(model.parameters(), max_norm)
    return None if norm is None else float(norm)
