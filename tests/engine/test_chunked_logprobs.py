"""Chunked log-probs from hidden states give the full-logits path's values and gradients, without the logits."""

from __future__ import annotations

import sys

import pytest
import torch

from rloo_engine import algorithm as A
from rloo_engine.logprobs import (
    chunkable_head,
    chunked_head_difference,
    chunked_token_log_probs,
    completion_token_logps,
)
from rloo_engine.testing import tiny_models


def _head(vocab=97, hidden=16, bias=False, dtype=torch.float32):
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
    h = torch.randn(3, 7, hidden, dtype=dtype, requires_grad=True)
    tokens = torch.randint(0, vocab, (3, 7))
    return head, h, tokens


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_entropy_and_gradients_match_the_full_logits_in_fp32(bias, temperature):
    head, h, tokens = _head(bias=bias)
    weights = torch.randn(3, 7)  # a loss that weighs every position differently
    ref_logps, ref_entropy = A.token_log_probs(head(h), tokens, temperature, with_entropy=True)
    (ref_logps * weights).sum().backward()
    ref_grads = [t.grad.clone() for t in (h, head.weight, *([head.bias] if bias else []))]
    for t in (h, head.weight, head.bias):
        if t is not None:
            t.grad = None
    logps, entropy = chunked_token_log_probs(h, head, tokens, temperature, with_entropy=True, chunk=4)  # 21 = 4+4+..+1
    (logps * weights).sum().backward()
    grads = [t.grad for t in (h, head.weight, *([head.bias] if bias else []))]
    assert torch.allclose(logps, ref_logps, atol=1e-6) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-6)


def test_the_entropy_carries_no_gradient_and_a_loss_through_it_fails_loudly():
    head, h, tokens = _head()
    logps, entropy = chunked_token_log_probs(h, head, tokens, 1.0, with_entropy=True, chunk=4)
    assert logps.requires_grad and not entropy.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):  # never a silent zero gradient
        entropy.sum().backward()


def test_bf16_autocast_matches_the_head_run_under_autocast():
    head, h, tokens = _head()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = A.token_log_probs(head(h), tokens)
        got, _ = chunked_token_log_probs(h, head, tokens, chunk=5)
    assert torch.allclose(got, ref, atol=1e-6)  # the same bf16 matmul, then float32 log-softmax


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    tok = tiny_models.train_tokenizer(vocab_size=300)
    path = tiny_models.build_causal_lm(root / "m", tok)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def test_the_model_path_matches_the_full_logits_and_never_builds_them(model):
    torch.manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (4, 12))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    assert chunkable_head(model) is model.lm_head
    shapes = []
    handle = model.lm_head.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    try:
        got, got_entropy = completion_token_logps(model, ids, mask, 5, 1.0, with_entropy=True, chunked=True)
    finally:
        handle.remove()
    want, want_entropy = completion_token_logps(model, ids, mask, 5, 1.0, with_entropy=True, chunked=False)
    assert shapes[0] == (4, 0, model.config.vocab_size)  # the head's own output was empty
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got_entropy, want_entropy, atol=1e-5)
    got.sum().backward()
    chunked_grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad()
    want.sum().backward()
    assert torch.allclose(chunked_grad, model.model.layers[0].mlp.up_proj.weight.grad, atol=1e-6)


def test_heads_it_cannot_reproduce_fall_back(model):
    model.config.final_logit_softcapping = 30.0
    try:
        assert chunkable_head(model) is None
    finally:
        model.config.final_logit_softcapping = None
    wrapped = torch.nn.Sequential(torch.nn.Linear(2, 2))  # no get_output_embeddings
    assert chunkable_head(wrapped) is None


def test_a_training_run_with_chunked_log_probs_matches_the_full_logits_run(tmp_path, qwen2_model):
    from rloo_engine.trainer import RLOOTrainer
    from tests.engine.helpers import read_metrics, tiny_config

    weights = {}
    for chunked in (False, True):
        cfg = tiny_config(tmp_path / str(chunked), qwen2_model, beta=0.1, max_steps=3, learning_rate=3e-2,
                          sampling_logprobs="forward", chunked_logprobs=chunked)
        trainer = RLOOTrainer(cfg)
        head_outputs = []
        trainer.acc.unwrap_model(trainer.policy).lm_head.register_forward_hook(
            lambda m, a, out, seen=head_outputs: seen.append(out.shape[1]))
        trainer.train()
        assert (0 in head_outputs) == chunked  # the chunked runs really bypassed the full logits
        weights[chunked] = {k: v.detach().clone() for k, v in trainer.acc.unwrap_model(trainer.policy).state_dict().items()}
    metrics = {c: read_metrics(tmp_path / str(c) / "out")[-1] for c in (False, True)}
    for key in ("loss", "sequence_kl", "reward", "entropy"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], abs=1e-4), key
    moved = max((weights[False][k] - weights[True][k]).abs().max().item() for k in weights[False])
    assert moved < 1e-4


def test_a_logit_transform_nobody_listed_is_found_by_the_probe(model):
    # A multiplier applied after the head under an unlisted name: the attribute list misses it, the probe does not.
    assert chunked_head_difference(model) < 1e-5
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out * 2.5)
    try:
        assert chunkable_head(model) is model.lm_head
        assert chunked_head_difference(model) > 0.1
    finally:
        handle.remove()


@pytest.mark.parametrize("field", ["lm_head_multiplier", "final_logit_softcapping"])
def test_listed_transforms_on_the_text_config_of_a_composite_config_are_seen(model, field):
    class Composite:
        def get_text_config(self):
            return type("TextConfig", (), {field: 0.5})()

    inner = model.config
    model.config = Composite()
    try:
        assert chunkable_head(model) is None
    finally:
        model.config = inner


def test_training_falls_back_to_the_full_logits_when_the_probe_disagrees(tmp_path, qwen2_model, capsys):
    from rloo_engine.logprobs import probed_fast_paths
    from rloo_engine.trainer import RLOOTrainer
    from tests.engine.helpers import tiny_config

    trainer = RLOOTrainer(tiny_config(tmp_path, qwen2_model, beta=0.1, max_steps=1, chunked_logprobs=True))
    assert trainer.chunked_logprobs  # nothing transforms this model's logits: the probe agrees
    head = trainer.acc.unwrap_model(trainer.policy).lm_head
    handle = head.register_forward_hook(lambda module, args, out: out * 2.5)
    try:
        chunked, _ = probed_fast_paths(trainer.policy, len(trainer.tokenizer), trainer.acc.autocast, False,
                                       chunked=True, share=False, say=lambda line: print(line, file=sys.stderr))
        assert not chunked
    finally:
        handle.remove()
    assert "chunked_logprobs: on a probe batch it is up to" in capsys.readouterr().err
