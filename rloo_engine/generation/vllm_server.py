"""vLLM server generation backend (`vllm_mode: server`): a vLLM server of its own, e.g. on another GPU or node.

Rank 0 talks to the server; the other ranks send it their prompts and wait. Generation goes through the
OpenAI `/v1/completions` route with prompt token ids, so the server continues exactly the tokens the trainer
scores. Weights go through vLLM's weight-transfer API (`/init_weight_transfer_engine`, `/update_weights`,
...): NCCL on GPU, the `rloo_gloo` engine on CPU. Each sync's `/finish_weight_update` also sets the server's
weight version to the trainer's optimizer step, and `/reset_prefix_cache` drops the KV the old weights computed.

With `async_generation` the trainer `submit`s the next batch's prompts before updating on this one and
`collect`s them after, so the server generates while the trainer computes (one step off-policy).

Every call is bounded by `vllm_server_timeout`: a server that is down, dies or hangs fails the step with a
`VLLMServerError` naming the URL, on every rank, never a silent wait.
"""

from __future__ import annotations

import json
import socket
import threading
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from rloo_engine.distributed import is_shard
from rloo_engine.generation.base import Rollout, SamplingParams
from rloo_engine.generation.vllm_client import Pending, VLLMServerClient, VLLMServerError
from rloo_engine.generation.vllm_common import (
    alias_indices,
    full_tensor,
    import_vllm,
    one_at_a_time,
    prompt_token_ids,
    to_rollout,
    vllm_weight_items,
)

__all__ = ["VLLMServerBackend", "VLLMServerError"]


class _ItemsSource:
    """A vLLM `WeightSource` over the (name, tensor) pairs of the current sync.

    An FSDP2 shard is made whole when iteration reaches it (`full_tensor`, a collective): rank 0 gathers as it
    sends, and every other rank must make the same gathers in the same order (`finish_pass`)."""

    def __init__(self):
        self.items: list[tuple[str, torch.Tensor]] = []
        self.gathered = 0  # how many of this pass's items are whole

    @property
    def sharded(self) -> bool:
        return any(is_shard(t) for _, t in self.items)

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.items]  # a DTensor's shape is the full one

    def same_as(self) -> list[int]:
        return alias_indices([t for _, t in self.items])

    def begin(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.items, self.gathered = items, 0

    def __iter__(self):
        self.gathered = 0
        for item in one_at_a_time(self.items):
            self.gathered += 1
            yield item

    def finish_pass(self) -> None:
        """Makes the gathers this pass has not made yet: a rank that sends nothing, or a sender whose send failed
        part way, so that the other ranks' gathers are not left waiting."""
        for _, tensor in self.items[self.gathered:]:
            full_tensor(tensor)
        self.gathered = len(self.items)


def _address_towards(host: str) -> str:
    """This machine's address on the route to `host` (NCCL's store is the trainer's; the server dials it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # UDP connect sends nothing
        return probe.getsockname()[0]


def server_weight_transfer(client: VLLMServerClient) -> str:
    """The server's weight-transfer backend (`--weight-transfer-config`), checked against this trainer's device:
    refused here, before any training, rather than at the first sync."""
    config = client.get("/server_info?config_format=json").get("vllm_config") or {}
    backend = (config.get("weight_transfer_config") or {}).get("backend")
    fix = "start it with `rloo-engine vllm-serve --model ...`, which sets it"
    if backend is None:
        raise VLLMServerError(f"vLLM server {client.base_url} was started without --weight-transfer-config, so it "
                              f"cannot take the trainer's weights; {fix}")
    if backend not in ("nccl", "ipc", "rloo_gloo"):
        raise VLLMServerError(f"vLLM server {client.base_url}: weight-transfer backend {backend!r}; the trainer "
                              "sends over nccl, ipc (a server on the trainer's own GPU) or rloo_gloo (CPU)")
    if backend != "rloo_gloo" and not torch.cuda.is_available():
        raise VLLMServerError(f"vLLM server {client.base_url}: weight-transfer backend {backend!r} needs CUDA in the "
                              "trainer, which has none; on CPU start the server with --weight_transfer rloo_gloo")
    return backend


def transfer_failure(base_url: str, group_port: int, err: Exception) -> str:
    """The one-line error of a weight-transfer group that did not form, with the fix where there is a known one."""
    if "Duplicate GPU" in str(err):  # NCCL refuses two ranks on one device (huggingface/trl#3706, #3158)
        return (f"vLLM server {base_url} runs on this trainer's GPU, where NCCL cannot form the weight-transfer "
                "group (Duplicate GPU detected); restart it with `rloo-engine vllm-serve --weight_transfer ipc ...` "
                "(CUDA IPC, for a server that shares the trainer's device)")
    return f"vLLM server {base_url}: weight-transfer group on port {group_port} failed: {type(err).__name__}: {err}"


def _ipc_engine(client, source, is_sender: bool):
    """vLLM's CUDA IPC trainer engine (a server on the trainer's own device): no group to join, handles by HTTP."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

    return IPCTrainerWeightTransferEngine.trainer_init(IPCTrainerInitInfo(rank=0 if is_sender else 1),
                                                       client=client, source=source)


@dataclass
class InFlight:
    """A generation request `submit` sent: this rank's prompt ids, and rank 0's future of everyone's results."""

    ids: list[list[int]]
    num_generations: int
    start: int  # this rank's first row in everyone's results
    result: Future


def _fill(future: Future, work) -> None:
    try:
        future.set_result(work())
    except BaseException as err:  # noqa: BLE001  raised again where `collect` waits, on every rank
        future.set_exception(err)


class VLLMServerBackend:
    serves_after_training = True  # the trainer pushes the final weights: the server then serves the trained policy

    def __init__(self, base_url: str, tokenizer, params: SamplingParams, acc, timeout: float = 240.0,
                 group_port: int = 51216, seed: int = 0, structured_outputs_regex: str | None = None):
        self.tokenizer, self.params, self.acc, self.seed = tokenizer, params, acc, seed
        self.structured_outputs_regex = structured_outputs_regex
        self.base_url = base_url.rstrip("/")
        self.eos_ids = list(params.eos_token_ids or (tokenizer.eos_token_id,))
        self.calls = 0
        self.source = _ItemsSource()
        self.client = self.engine = None
        self.model_id = ""
        self.transfer = self._on_main(lambda: self._connect(timeout, group_port))
        if self.transfer == "ipc" and not self.acc.is_main_process:
            # CUDA IPC: every rank joins the all-gather of its GPU's handles; rank 0 alone talks to the server.
            self.engine = _ipc_engine(None, self.source, is_sender=False)

    def _on_main(self, work):
        """Runs `work` on rank 0 and gives every rank its result, or raises its error on every rank."""
        from accelerate.utils import broadcast_object_list

        box: list[Any] = [None]
        if self.acc.is_main_process:
            try:
                box = [("ok", work())]
            except VLLMServerError as err:
                box = [("error", str(err))]
        if self.acc.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        status, value = box[0]
        if status == "error":
            raise VLLMServerError(value)
        return value

    def _connect(self, timeout: float, group_port: int) -> str:
        """Connects to the server and joins its weight-transfer engine; returns the engine's backend name."""
        import_vllm()
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        self.client = VLLMServerClient(self.base_url, timeout)
        self.client.wait_until_healthy()
        self.model_id = self.client.get("/v1/models")["data"][0]["id"]
        transfer = server_weight_transfer(self.client)
        if transfer == "ipc":
            self.client.post("/shutdown_weight_transfer_engine")
            self.engine = _ipc_engine(self.client, self.source, is_sender=True)
            return transfer
        world = 1 + int(self.client.get("/get_world_size")["world_size"])
        host = urlparse(self.base_url).hostname or "127.0.0.1"
        if transfer == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(_address_towards(host), group_port, world, rank=0)
        else:
            from rloo_engine.generation.vllm_gloo_transfer import GlooTrainerInitInfo, register

            register()
            info = GlooTrainerInitInfo(host, group_port, world, timeout, rank=0)
        try:
            self.client.post("/shutdown_weight_transfer_engine")  # a crashed earlier run's group, if any
            self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)
        except VLLMServerError:
            raise
        except Exception as err:  # a store or group timeout: the server never joined
            raise VLLMServerError(transfer_failure(self.base_url, group_port, err)) from None
        return transfer

    # ------------------------------------------------------------------ generation
    def _body(self, ids: list[int], n: int, seed: int) -> dict:
        p = self.params
        body: dict[str, Any] = dict(model=self.model_id, prompt=ids, n=n, max_tokens=p.max_completion_length,
                                    temperature=p.temperature, top_p=p.top_p, min_p=p.min_p or 0.0,
                                    repetition_penalty=p.repetition_penalty, stop_token_ids=self.eos_ids,
                                    logprobs=0, return_token_ids=True, skip_special_tokens=False, seed=seed)
        if p.top_k:
            body["top_k"] = p.top_k
        body.update(p.extra or {})
        if self.structured_outputs_regex is not None:  # vLLM's completions API takes StructuredOutputsParams' fields
            body["structured_outputs"] = {"regex": self.structured_outputs_regex}
        return body

    def _seed(self, ids: list[int], occurrence: int) -> int:
        # Per prompt, not per batch: the same prompts get the same samples however they are split over ranks.
        return zlib.crc32(json.dumps([self.seed, self.calls, occurrence, ids]).encode()) & 0x7FFFFFFF

    def _seeds(self, prompt_ids: list[list[int]]) -> list[int]:
        seen: dict[str, int] = {}
        seeds = []
        for ids in prompt_ids:
            key = json.dumps(ids)
            seen[key] = seen.get(key, -1) + 1
            seeds.append(self._seed(ids, seen[key]))
        return seeds

    def _send_all(self, prompt_ids: list[list[int]], n: int, seeds: list[int]) -> list[Pending]:
        # One request per prompt (its own seed: one seed over several prompts would draw them from one stream).
        return [self.client.send("POST", "/v1/completions", self._body(ids, n, seed))
                for ids, seed in zip(prompt_ids, seeds)]

    def _receive_all(self, sent: list[Pending]) -> list[tuple[list[int], list[float]]]:
        out = []
        for pending in sent:
            for choice in sorted(self.client.receive(pending)["choices"], key=lambda c: c["index"]):
                logps = (choice.get("logprobs") or {}).get("token_logprobs") or []
                out.append((list(choice["token_ids"]), [float(x) for x in logps]))
        return out

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False) -> Rollout:
        return self.collect(self.submit(prompts, num_generations, add_special_tokens))

    def submit(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False) -> InFlight:
        """Sends every rank's prompts to the server and returns at once (`async_generation`); `collect` waits.

        The collective part (gathering the prompts on rank 0) and the sending of every request run here, in
        the caller's thread, so the server has the whole batch before the trainer's work starts; a daemon
        thread of rank 0 reads the replies while the update runs, and no collective ever runs off the main
        thread."""
        from accelerate.utils import gather_object

        ids = prompt_token_ids(self.tokenizer, prompts, self.params.max_prompt_length, add_special_tokens)
        everyone = gather_object([ids]) if self.acc.num_processes > 1 else [ids]
        self.calls += 1
        result: Future = Future()
        if self.acc.is_main_process:
            everyone_ids = [p for rank in everyone for p in rank]
            try:  # on the wire before the trainer's work takes the GIL; a failure is raised by `collect`
                sent = self._send_all(everyone_ids, num_generations, self._seeds(everyone_ids))
            except VLLMServerError as err:
                result.set_exception(err)
            else:
                threading.Thread(target=_fill, args=(result, lambda: self._receive_all(sent)), daemon=True,
                                 name="rloo-vllm-generate").start()
        start = sum(len(r) for r in everyone[: self.acc.process_index]) * num_generations
        return InFlight(ids, num_generations, start, result)

    @torch.no_grad()
    def collect(self, request: InFlight) -> Rollout:
        """Waits for `request` (every rank: the results are broadcast from rank 0) and returns this rank's rollout."""
        results = self._on_main(request.result.result)
        G = request.num_generations
        mine = results[request.start: request.start + len(request.ids) * G]
        return to_rollout(request.ids, [c for c, _ in mine], G, self.tokenizer.pad_token_id, self.eos_ids,
                           [lp for _, lp in mine])

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        # Every rank builds the items (a merge or a ZeRO gather is collective); only rank 0 sends them. FSDP2
        # shards are gathered one at a time as rank 0 sends them, the other ranks gathering alongside.
        with vllm_weight_items(model) as items:
            self.source.begin(items)
            try:
                if self.transfer == "ipc" and not self.acc.is_main_process:
                    self.engine.send_weights()  # this rank's share of the handle all-gather
                elif self.source.sharded and not self.acc.is_main_process:
                    self.source.finish_pass()
                self._on_main(lambda: self._push(step))
            finally:
                self.source.begin([])

    def _push(self, step: int) -> None:
        self.client.next_weight_version = str(step)
        try:
            self.engine.send_weights()
            # vLLM's finish_weight_update keeps the prefix cache: a prompt prefix cached before the sync (a system
            # prompt, the chat template, a second epoch) would be continued from KV of the old weights.
            self.client.reset_prefix_cache()
        except Exception as err:
            self.source.finish_pass()  # FSDP2: the other ranks are still in this pass's gathers
            if isinstance(err, VLLMServerError):
                raise
            # the group's peer died or timed out mid-transfer
            raise VLLMServerError(f"vLLM server {self.base_url}: weight sync failed: {type(err).__name__}: "
                                  f"{err}") from None

    def close(self) -> None:
        """Leaves the server's weight-transfer group (the server keeps serving the last weights)."""
        if self.engine is not None and self.client is not None:
            try:  # briefly: after a failure the server may be the thing that hangs
                self.client.post("/shutdown_weight_transfer_engine", timeout=min(2.0, self.client.timeout))
            except VLLMServerError:
                pass  # a dead server has no group to leave; the run's own error is already on its way
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.client is not None:
            self.client.close()
