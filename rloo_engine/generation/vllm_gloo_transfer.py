"""A gloo weight-transfer engine for vLLM's weight-transfer API, so that server-mode sync runs on CPU.

vLLM 0.3x moves trainer weights into a running server through `vllm.distributed.weight_transfer`: the
trainer posts `/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` and
`/finish_weight_update`, and a transfer engine inside each vLLM worker receives the tensors. Its built-in
engines (nccl, ipc) need CUDA. This one is the same protocol over a gloo process group of the trainer's
rank 0 (the sender, group rank 0) and every vLLM worker, registered under the name `rloo_gloo`:

- in every vLLM process by rloo-pipeline's `vllm.general_plugins` entry point `rloo_gloo`;
- in the trainer by `register()`, before `WeightTransferTrainerFactory.trainer_init`.

The vLLM worker holds the group's TCPStore on `master_port` (the trainer's `vllm_group_port`), as TRL's
server does, so the trainer needs only the server's address. Both sides use `timeout_s` for every collective:
a server that dies during a sync fails the sync within it instead of hanging.
"""

from __future__ import annotations

import gc
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "rloo_gloo"


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker side: where the group's store is (served by worker rank 0) and this group's size."""

    master_address: str
    master_port: int
    world_size: int  # the trainer sender + every vLLM worker
    rank_offset: int = 1
    timeout_s: float = 240.0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the vLLM server's address for the group store, as the worker will open it."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 240.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0  # > 0: tensors travel packed, one broadcast per bucket (`buckets`); 0: one per tensor
    # same_as[i] = j < i: name i is tensor j again (a tied lm_head and its embedding), loaded under both names but
    # sent once; empty or same_as[i] == i: its own tensor.
    same_as: list[int] = field(default_factory=list)


# Why packed: a broadcast and a `load_weights` call per tensor cost ~1 ms each on loopback gloo whatever the
# tensor's size, which for a small policy is most of a sync. A bucket bounds the extra copy of the weights.
BUCKET_BYTES = 64 * 2**20


def buckets(dtype_names: list[str], shapes: list[list[int]], bucket_bytes: int,
            same_as: list[int] | None = None) -> list[list[int]]:
    """Indices of the tensors that travel together: consecutive ones of one dtype, up to `bucket_bytes` in all
    (a larger tensor alone), leaving out those that repeat an earlier one (`same_as`). Sender and receiver compute
    the same grouping from the update info."""
    groups: list[list[int]] = []
    size = 0
    for index, (dtype_name, shape) in enumerate(zip(dtype_names, shapes)):
        if same_as and same_as[index] != index:
            continue
        nbytes = math.prod(shape) * getattr(torch, dtype_name).itemsize
        if groups and dtype_name == dtype_names[groups[-1][0]] and size + nbytes <= bucket_bytes:
            groups[-1].append(index)
            size += nbytes
        else:
            groups.append([index])
            size = nbytes
    return groups


def _group(address: str, port: int, rank: int, world_size: int, timeout_s: float, serve_store: bool):
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=serve_store, timeout=timeout,
                          wait_for_workers=False)
    # A group of its own (not the default one): the trainer's DDP group and vLLM's own stay untouched.
    return dist.ProcessGroupGloo(dist.PrefixStore("rloo_weights", store), rank, world_size, timeout), store


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Inside a vLLM worker: receives each tensor by broadcast and loads it with vLLM's layerwise reload."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.store = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.shutdown()  # a previous trainer's group (one that crashed without shutting it down) holds the port
        p = self.parallel_config
        worker_rank = p.data_parallel_index * p.world_size + p.rank
        self.group, self.store = _group(
            "0.0.0.0" if worker_rank == 0 else init_info.master_address, init_info.master_port,
            worker_rank + init_info.rank_offset, init_info.world_size, init_info.timeout_s,
            serve_store=worker_rank == 0)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("rloo_gloo weight transfer is not initialised: call /init_weight_transfer_engine")
        info = update_info
        if not info.bucket_bytes:
            for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, weight)
                self.model.load_weights([(name, weight.to(self.device))])
            return
        repeated = {j: [i for i, k in enumerate(info.same_as) if k == j and i != j] for j in set(info.same_as)}
        for group in buckets(info.dtype_names, info.shapes, info.bucket_bytes, info.same_as):
            sizes = [math.prod(info.shapes[i]) for i in group]
            # A new buffer per bucket: the layerwise reload may hold the views it was given until a layer is whole.
            flat = torch.empty(sum(sizes), dtype=getattr(torch, info.dtype_names[group[0]]))
            _broadcast(self.group, flat)
            weights = [(i, view.view(info.shapes[i]).to(self.device)) for i, view in zip(group, flat.split(sizes))]
            # a repeated tensor is loaded under its other names too (vLLM's reload needs each layer's weight)
            self.model.load_weights([(info.names[k], w) for i, w in weights for k in [i, *repeated.get(i, [])]])

    def shutdown(self) -> None:
        self.group = self.store = None
        gc.collect()  # the store's listening socket closes with its last reference


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """In the trainer: drives the HTTP round trip and broadcasts each tensor from group rank 0."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = None
        self.store = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(init_info.master_address, init_info.master_port,
                                                 init_info.world_size, 1, init_info.timeout_s)
        # The worker blocks in init until every rank has joined: our join runs beside the HTTP call, in a daemon
        # thread, so that a refused init (its error says more than a store timeout) never waits for it.
        joined: dict = {}

        def join():
            try:
                joined["group"] = _group(init_info.master_address, init_info.master_port, 0, init_info.world_size,
                                         init_info.timeout_s, serve_store=False)
            except Exception as err:  # noqa: BLE001 - re-raised in the caller's thread
                joined["error"] = err

        thread = threading.Thread(target=join, daemon=True, name="rloo-gloo-join")
        thread.start()
        client.init_weight_transfer_engine(asdict(worker_info))
        thread.join(init_info.timeout_s)
        if "error" in joined or "group" not in joined:
            raise RuntimeError(f"joining the weight-transfer group at {init_info.master_address}:"
                               f"{init_info.master_port}: {joined.get('error', 'timed out')}")
        engine.group, engine.store = joined["group"]
        return engine

    def send_weights(self) -> None:
        """Sends the source bucket by bucket, reading it in order as it goes: a sharded source (FSDP2) is gathered
        one tensor at a time, so the sender holds one bucket of whole tensors at most. The source is trainer-side
        `_ItemsSource` (its `same_as` finds a tied weight's second name without gathering it)."""
        if not self.is_sender:
            for _ in self.source:
                pass  # a sharded source's gathers are collective
            return
        meta = self.source.metadata()
        info = GlooWeightTransferUpdateInfo([m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta],
                                            [list(m.shape) for m in meta], BUCKET_BYTES, self.source.same_as())
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, asdict(info))
            tensors = (t for _, t in self.source)
            read = -1
            for group in buckets(info.dtype_names, info.shapes, info.bucket_bytes, info.same_as):
                flat = []
                for index in group:  # ascending; the repeats buckets() leaves out are read and dropped
                    while read < index:
                        tensor, read = next(tensors), read + 1
                    flat.append(tensor.detach().to("cpu").reshape(-1))
                _broadcast(self.group, torch.cat(flat))
            for _ in tensors:
                pass  # trailing repeats: a sharded source gathers them on every rank
            future.result()
        finally:
            # A failed broadcast leaves the HTTP call waiting on a dead peer: never join it here.
            pool.shutdown(wait=False)
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = self.store = None


def register() -> None:
    """Registers `rloo_gloo` with vLLM's engine and trainer factories (idempotent: vLLM loads plugins per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
