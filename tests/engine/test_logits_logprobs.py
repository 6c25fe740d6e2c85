"""Log-probs from the full logits with the gradient written over them: `algorithm.token_log_probs`'s values,
entropy and gradients, in pieces along the positions, in float32 and bf16, and a retained graph refused."""

from __future__ import annotations

import pytest
import torch

from rloo_engine import algorithm as A
from rloo_engine import logits_logprobs
from rloo_engine.logits_logprobs import logits_token_log_probs


def _logits(dtype=torch.float32, B=3, T=7, V=97):
    torch.manual_seed(0)
    h = torch.randn(B, T, 16, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(16, V, bias=False, dtype=dtype)
    return h, head, torch.randint(0, V, (B, T))


def _reference(h, head, tokens, temperature, weights):
    logps, entropy = A.token_log_probs(head(h), tokens, temperature, with_entropy=True)
    (logps * weights).sum().backward()
    grads = (h.grad.clone(), head.weight.grad.clone())
    h.grad = head.weight.grad = None
    return logps.detach(), entropy, grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("splits", [[7], [1, 6], [3, 2, 2]])
def test_values_entropy_and_gradients_are_token_log_probs_ones(temperature, splits, monkeypatch):
    monkeypatch.setattr(logits_logprobs, "_CHUNK_LOGITS", 2 * 97)  # chunks of 2 positions: 7 = 2+2+2+1
    h, head, tokens = _logits()
    weights = torch.randn(3, 7)  # a loss that weighs every position differently
    want, want_entropy, want_grads = _reference(h, head, tokens, temperature, weights)
    pieces = list(head(h).split(splits, dim=1))
    got, entropy = logits_token_log_probs(pieces, tokens, temperature, with_entropy=True)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same float32 operations
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=0)
    for got_grad, want_grad in zip((h.grad, head.weight.grad), want_grads):
        torch.testing.assert_close(got_grad, want_grad, atol=1e-6, rtol=1e-5)
    assert not entropy.requires_grad


def test_the_logits_hold_their_gradient_after_the_backward():
    # No second (B, T, V) buffer: the LM head's backward reads the gradient from the logits' own memory.
    h, head, tokens = _logits()
    reference = head(h).detach().requires_grad_()
    A.token_log_probs(reference, tokens)[0].sum().backward()
    logits = head(h)
    logps, _ = logits_token_log_probs([logits], tokens)
    logps.sum().backward()
    torch.testing.assert_close(logits.detach(), reference.grad, atol=1e-6, rtol=0)


def test_bf16_logits_get_a_bf16_gradient_of_the_float32_math():
    h, head, tokens = _logits(torch.bfloat16)
    want, _, want_grads = _reference(h, head, tokens, 1.0, torch.ones(3, 7))
    got, _ = logits_token_log_probs([head(h)], tokens)
    got.sum().backward()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert h.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad, want_grads[0], atol=1e-2, rtol=1e-2)


def test_a_second_backward_through_the_same_graph_is_refused_not_wrong():
    h, head, tokens = _logits()
    logps, _ = logits_token_log_probs([head(h)], tokens)
    logps.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logps.sum().backward()


def test_pieces_that_do_not_cover_the_tokens_are_refused():
    h, head, tokens = _logits()
    with pytest.raises(ValueError, match=r"cover \[6\] positions; tokens have 7"):
        logits_token_log_probs([head(h)[:, :6]], tokens)


def test_without_gradient_it_reads_the_logits_and_changes_nothing():
    h, head, tokens = _logits()
    with torch.no_grad():
        logits = head(h)
        before = logits.clone()
        got, _ = logits_token_log_probs([logits], tokens, 0.7)
        want, _ = A.token_log_probs(logits, tokens, 0.7)
    assert torch.equal(logits, before) and torch.equal(got, want)
