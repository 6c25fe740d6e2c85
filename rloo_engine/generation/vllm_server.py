"""vLLM server generation backend (`vllm_mode: server`): a vLLM server of its own, e.g. on another GPU or node.

Rank 0 talks to the server; the other ranks send it their prompts and wait. Generation goes through the
OpenAI `/v1/completions` route with prompt token ids, so the server continues exactly the tokens the trainer
scores. A vision-language model's prompts go to vLLM's tokens-in route, `/inference/v1/generate` (mounted by
`--enable-scale-out`, which `rloo-engine vllm-serve` sets): the ids with the chat template's placeholder per image,
and the images beside them as PNG data URLs (lossless: the server decodes the pixels the trainer processed). The
server expands each image's placeholder as colocate's engine does, and its expanded prompt must be the one the
trainer's processor wrote (checked on every reply).

Weights go through vLLM's weight-transfer API (`/init_weight_transfer_engine`, `/update_weights`, ...): NCCL on
GPU, the `rloo_gloo` engine on CPU. Each sync's `/finish_weight_update` also sets the server's weight version to
the trainer's optimizer step, and `/reset_prefix_cache` drops the KV the old weights computed (and
`/reset_encoder_cache` a vision tower's outputs).

With `async_generation` the trainer `submit`s the next batch's prompts before updating on this one and
`collect`s them after, so the server generates while the trainer computes (one step off-policy).

Every call is bounded by `vllm_server_timeout`: a server that is down, dies or hangs fails the step with a
`VLLMServerError` naming the URL, on every rank, never a silent wait.
"""

from __future__ import annotations

import base64
import io
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
    expansion_mismatch,
    full_tensor,
    import_vllm,
    one_at_a_time,
    prompt_token_ids,
    suppressing,
    to_rollout,
    vision_prompt_token_ids,
    vllm_weight_items,
)
from rloo_engine.vision import VisionRows

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


# vLLM's tokens-in route: prompt ids with images beside them (a vision-language model's prompts).
TOKENS_ROUTE = "/inference/v1/generate"


@dataclass
class InFlight:
    """A generation request `submit` sent: this rank's prompt ids, and rank 0's future of everyone's results."""

    ids: list[list[int]]
    num_generations: int
    start: int  # this rank's first row in everyone's results
    result: Future
    vision: VisionRows | None = None  # this rank's prompts' pixel inputs (a vision-language model)


# The modes PNG holds; others (a CMYK or YCbCr JPEG) go as RGB, the mode the processors on both sides convert to.
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "I", "I;16")


def image_data_url(image) -> str:
    """A PIL image as a PNG data URL: lossless, so the server decodes the very pixels the trainer processed."""
    buffer = io.BytesIO()
    (image if image.mode in PNG_MODES else image.convert("RGB")).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def check_tokens_route(client: VLLMServerClient) -> None:
    """A vision-language model's prompts need the tokens-in route: refused at connect, before any training, when
    the server was started without it. An empty body is invalid there (400/422), where the route is off (403) or
    absent (404)."""
    try:
        client.post(TOKENS_ROUTE, {})
    except VLLMServerError as err:
        if "HTTP 403" in str(err) or "HTTP 404" in str(err):
            raise VLLMServerError(f"vLLM server {client.base_url} has no {TOKENS_ROUTE} route, which a "
                                  "vision-language model's prompts with images need; restart it with "
                                  "--enable-scale-out (`rloo-engine vllm-serve` sets it)") from None
        if "HTTP 400" not in str(err) and "HTTP 422" not in str(err):
            raise


def _fill(future: Future, work) -> None:
    try:
        future.set_result(work())
    except BaseException as err:  # noqa: BLE001  raised again where `collect` waits, on every rank
        future.set_exception(err)


class VLLMServerBackend:
    serves_after_training = True  # the trainer pushes the final weights: the server then serves the trained policy

    def __init__(self, base_url: str, tokenizer, params: SamplingParams, acc, timeout: float = 240.0,
                 group_port: int = 51216, seed: int = 0, structured_outputs_regex: str | None = None,
                 processor=None, own_positions: bool = False, placeholder_ids: tuple[int, ...] = ()):
        """`processor`: a vision-language model's, for prompts with images (`generate(images=...)`);
        `own_positions` as `VisionRows` says; `placeholder_ids`: its image tokens, which sampling suppresses."""
        self.tokenizer, self.params, self.acc, self.seed = tokenizer, params, acc, seed
        self.structured_outputs_regex = structured_outputs_regex
        self.processor, self.own_positions, self.placeholder_ids = processor, own_positions, placeholder_ids
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
        if self.processor is not None:
            check_tokens_route(self.client)
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

    def _tokens_body(self, ids: list[int], image_urls: list[str], n: int, seed: int) -> dict:
        """The same request for the tokens-in route: the sampling fields as vLLM's `SamplingParams`, the images as
        content parts, and the image tokens suppressed (a sampled one would have no features to match)."""
        sampling = suppressing(self._body(ids, n, seed), self.placeholder_ids)
        for key in ("model", "prompt", "return_token_ids"):
            del sampling[key]
        return dict(model=self.model_id, token_ids=ids, sampling_params=sampling, return_token_ids=True,
                    content_parts=[{"type": "image_url", "url": url} for url in image_urls])

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

    def _send_all(self, prompt_ids: list[list[int]], n: int, seeds: list[int],
                  image_urls: list[list[str]] | None = None) -> list[Pending]:
        # One request per prompt (its own seed: one seed over several prompts would draw them from one stream).
        if image_urls is None:
            return [self.client.send("POST", "/v1/completions", self._body(ids, n, seed))
                    for ids, seed in zip(prompt_ids, seeds)]
        return [self.client.send("POST", TOKENS_ROUTE, self._tokens_body(ids, urls, n, seed))
                for ids, urls, seed in zip(prompt_ids, image_urls, seeds)]

    def _receive_all(self, sent: list[Pending], expanded: list[list[int]] | None = None
                     ) -> list[tuple[list[int], list[float]]]:
        """Each completion's token ids and log-probs, in request order. `expanded`: each prompt as the trainer scores
        it, which the server's expansion of its images must equal."""
        out = []
        for k, pending in enumerate(sent):
            reply = self.client.receive(pending)
            if expanded is not None and (problem := expansion_mismatch(reply["prompt_token_ids"], expanded[k], k)):
                raise VLLMServerError(f"vLLM server {self.base_url}: {problem}")
            for choice in sorted(reply["choices"], key=lambda c: c["index"]):
                logprobs = choice.get("logprobs") or {}
                if "content" in logprobs:  # the tokens-in route's: one entry per sampled token
                    logps = [entry["logprob"] for entry in logprobs["content"] or []]
                else:
                    logps = logprobs.get("token_logprobs") or []
                out.append((list(choice["token_ids"]), [float(x) for x in logps]))
        return out

    @torch.no_grad()
    def generate(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False,
                 images: list[list] | None = None) -> Rollout:
        return self.collect(self.submit(prompts, num_generations, add_special_tokens, images))

    def submit(self, prompts: list[str], num_generations: int, add_special_tokens: bool = False,
               images: list[list] | None = None) -> InFlight:
        """Sends every rank's prompts to the server and returns at once (`async_generation`); `collect` waits.
        `images`: each prompt's images (a vision-language model).

        The collective part (gathering the prompts on rank 0) and the sending of every request run here, in
        the caller's thread, so the server has the whole batch before the trainer's work starts; a daemon
        thread of rank 0 reads the replies while the update runs, and no collective ever runs off the main
        thread."""
        from accelerate.utils import gather_object

        if images is None:
            ids = prompt_token_ids(self.tokenizer, prompts, self.params.max_prompt_length, add_special_tokens)
            mine, vision = [(ids, None, None)], None
        else:  # the server expands the images itself, as the trainer's processor must (checked when it answers)
            with_images = vision_prompt_token_ids(self.processor, prompts, images, self.params.max_prompt_length,
                                                  self.own_positions, add_special_tokens)
            ids, vision = with_images.expanded, with_images.vision
            urls = [[image_data_url(i) for i in prompt_images] for prompt_images in images]
            mine = [(with_images.sent, ids, urls)]
        everyone = gather_object(mine) if self.acc.num_processes > 1 else mine
        self.calls += 1
        result: Future = Future()
        if self.acc.is_main_process:
            sent_ids = [p for rank, _, _ in everyone for p in rank]
            expanded = None if images is None else [p for _, rank, _ in everyone for p in rank]
            urls = None if images is None else [u for _, _, rank in everyone for u in rank]
            # seeded by the prompt the trainer scores, as a text prompt is
            seeds = self._seeds(sent_ids if expanded is None else expanded)
            try:  # on the wire before the trainer's work takes the GIL; a failure is raised by `collect`
                sent = self._send_all(sent_ids, num_generations, seeds, urls)
            except VLLMServerError as err:
                result.set_exception(err)
            else:
                threading.Thread(target=_fill, args=(result, lambda: self._receive_all(sent, expanded)), daemon=True,
                                 name="rloo-vllm-generate").start()
        start = sum(len(rank) for rank, _, _ in everyone[: self.acc.process_index]) * num_generations
        return InFlight(ids, num_generations, start, result, vision)

    @torch.no_grad()
    def collect(self, request: InFlight) -> Rollout:
        """Waits for `request` (every rank: the results are broadcast from rank 0) and returns this rank's rollout."""
        results = self._on_main(request.result.result)
        G = request.num_generations
        mine = results[request.start: request.start + len(request.ids) * G]
        rollout = to_rollout(request.ids, [c for c, _ in mine], G, self.tokenizer.pad_token_id, self.eos_ids,
                             [lp for _, lp in mine])
        rollout.vision = None if request.vision is None else request.vision.repeat(G)
        return rollout

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
            if self.processor is not None:  # and the images' vision-tower outputs, computed by the old weights
                self.client.post("/reset_encoder_cache")
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
