"""Each released model family, in miniature (tiny_chat_models.FAMILIES): trains on chat prompts, resumes exactly,
starts at a KL of exactly 0, and decodes with the fused loop where it covers the family and says so where not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rloo_engine.generation.base import SamplingParams
from rloo_engine.run.fault_injection import CRASH_ENV, CRASH_EXIT_CODE
from rloo_engine.testing.tiny_chat_models import build_family_model
from rloo_engine.trainer import RLOOTrainer
from tests.engine.helpers import prompt_file, read_metrics, tiny_config
from tests.engine.test_fused_decode import _sample_both

# family -> what fused_decode says when it leaves the family to `generate` (None: the fused loop decodes it)
FUSED_REFUSAL = {
    "llama3": None,
    "qwen3": None,
    "mistral": None,
    "gemma2": "Gemma2ForCausalLM is not one of",
    "gemma3": "Gemma3ForCausalLM is not one of",
    "phi3": "Phi3ForCausalLM is not one of",
    # Mixture-of-Experts, trained without the router's load-balancing loss (router_aux_loss_coef is not built yet)
    "qwen2_moe": "Qwen2MoeForCausalLM is not one of",
    "qwen3_moe": "Qwen3MoeForCausalLM is not one of",
    "mixtral": "MixtralForCausalLM is not one of",
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_model(root / family, family) for family in FUSED_REFUSAL}


def _run(tmp_path: Path, model: Path, **overrides):
    """Chat prompts, a KL penalty, and a generation batch reused over 2 x 2 optimizer steps (a checkpoint at step 2
    falls inside it); pi_old and the reference from the trainer's forward, so identical models give a KL of 0."""
    cfg = tiny_config(tmp_path, model, dataset_name=str(prompt_file(tmp_path, n=16, conversational=True)),
                      max_steps=4, save_steps=2, beta=0.05, num_iterations=2, steps_per_generation=2,
                      per_device_train_batch_size=4, sampling_logprobs="forward", **overrides)
    trainer = RLOOTrainer(cfg)
    return cfg, trainer, trainer.train()


@pytest.mark.parametrize("family", list(FUSED_REFUSAL))
def test_family_trains_resumes_exactly_and_starts_at_kl_0(family, family_models, tmp_path, monkeypatch, capfd):
    model = family_models[family]
    straight, trainer, _ = _run(tmp_path / "a", model)
    said = capfd.readouterr().err
    if FUSED_REFUSAL[family] is None:
        assert trainer.backend._fused is True and "fused_decode:" not in said
    else:
        assert trainer.backend._fused is False
        assert f"rloo-engine: fused_decode: {FUSED_REFUSAL[family]}" in said and "decoding with HF generate" in said

    monkeypatch.setenv(CRASH_ENV, "2")  # dies right after the step-2 checkpoint, inside a generation batch
    with pytest.raises(SystemExit) as exit_info:
        _run(tmp_path / "b", model)
    assert exit_info.value.code == CRASH_EXIT_CODE
    monkeypatch.delenv(CRASH_ENV)
    resumed, _, result = _run(tmp_path / "b", model, resume_from_checkpoint="latest")
    assert result.global_step == 4

    a = AutoModelForCausalLM.from_pretrained(Path(straight.output_dir) / "final")
    b = AutoModelForCausalLM.from_pretrained(Path(resumed.output_dir) / "final")
    before = AutoModelForCausalLM.from_pretrained(model)
    changed = 0
    for (name, pa), (_, pb), (_, p0) in zip(a.named_parameters(), b.named_parameters(), before.named_parameters()):
        torch.testing.assert_close(pa, pb, msg=f"{family}: parameter {name} differs after resume")
        changed += not torch.equal(pa, p0)
    assert changed > 0  # it trained
    ma, mb = read_metrics(straight.output_dir), read_metrics(resumed.output_dir)
    assert [r["step"] for r in mb] == [1, 2, 3, 4]
    for ra, rb in zip(ma, mb):
        for key in set(ra) - {"step_time"} - {k for k in ra if k.startswith("timing/")}:
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), (family, ra["step"], key)
    assert ma[0]["kl"] == 0.0 and ma[0]["sequence_kl"] == 0.0  # step 1: the policy is the reference


@pytest.mark.parametrize("family", [f for f, refusal in FUSED_REFUSAL.items() if refusal is None])
def test_the_fused_loop_samples_what_generate_samples(family, family_models, monkeypatch):
    """As test_fused_decode does for Qwen2 and Llama: the same tokens and log-probs, at temperature and with top-k/p.
    Norm weights are moved off 1 so that the q/k norms of Qwen3 are read, not only normalised by."""
    model, tok = AutoModelForCausalLM.from_pretrained(family_models[family]), AutoTokenizer.from_pretrained(
        family_models[family])
    tok.pad_token = tok.pad_token or tok.eos_token  # as models.load_tokenizer does (Mistral and Llama 3 have none)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    params = SamplingParams(12, temperature=0.7, top_k=20, top_p=0.9)
    ours, theirs = _sample_both(model, tok, params, monkeypatch)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    assert torch.allclose(ours.sampling_logps, theirs.sampling_logps, atol=1e-5)
