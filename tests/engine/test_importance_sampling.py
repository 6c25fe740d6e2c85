"""vLLM's log-prob mismatch and the truncated importance-sampling correction: the pure math in algorithm.py."""

import math

import pytest
import torch

from rloo_engine import algorithm as A

# Two completions of 3 tokens; the second ends after 2 (its last slot is padding with garbage log-probs).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
TRAINER = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, -7.0]])
# log(pi_old / mu) per token: [0.5, -1.0, 2.0] and [0.1, 0.2, (masked) 9.0]
GENERATOR = TRAINER - torch.tensor([[0.5, -1.0, 2.0], [0.1, 0.2, 9.0]])


def weights(mode, clip_min=None, clip_max=3.0):
    return A.generator_importance_weights(TRAINER, GENERATOR, MASK, mode, clip_min, clip_max)


def test_token_truncate_clamps_each_token_ratio_and_zeroes_masked_tokens():
    w = weights("token_truncate", clip_min=0.5, clip_max=3.0)
    e = math.exp
    expected = torch.tensor([[e(0.5), 0.5, 3.0], [e(0.1), e(0.2), 0.0]])  # e^-1 < 0.5 -> 0.5; e^2 > 3 -> 3
    torch.testing.assert_close(w, expected)


def test_token_mask_zeroes_tokens_outside_the_bounds():
    w = weights("token_mask", clip_min=0.5, clip_max=3.0)
    e = math.exp
    torch.testing.assert_close(w, torch.tensor([[e(0.5), 0.0, 0.0], [e(0.1), e(0.2), 0.0]]))


def test_sequence_weights_are_the_product_over_real_tokens_only():
    # row 0: exp(0.5 - 1 + 2) = e^1.5 ~ 4.48 > 3; row 1: exp(0.1 + 0.2) (the masked 9.0 does not count)
    truncated = weights("sequence_truncate")
    masked = weights("sequence_mask")
    assert truncated.shape == masked.shape == (2, 1)
    torch.testing.assert_close(truncated, torch.tensor([[3.0], [math.exp(0.3)]]))
    torch.testing.assert_close(masked, torch.tensor([[0.0], [math.exp(0.3)]]))


def test_unbounded_sides_are_left_alone():
    torch.testing.assert_close(weights("sequence_truncate", clip_max=None, clip_min=0.1),
                               torch.tensor([[math.exp(1.5)], [math.exp(0.3)]]))
    # a lower bound only: e^-1 ~ 0.37 < 0.5 masked, e^2 kept
    w = weights("token_mask", clip_min=0.5, clip_max=None)
    assert w[0].tolist() == pytest.approx([math.exp(0.5), 0.0, math.exp(2.0)])


@pytest.mark.parametrize("mode", A.IMPORTANCE_SAMPLING_MODES)
def test_weights_are_exactly_one_when_the_generator_agrees_and_carry_no_gradient(mode):
    trainer = TRAINER.clone().requires_grad_(True)
    w = A.generator_importance_weights(trainer, TRAINER.clone(), MASK, mode, 0.5, 3.0)
    assert not w.requires_grad
    expected = MASK.float() if mode.startswith("token") else torch.ones(2, 1)
    assert torch.equal(w, expected)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode: 'tokens'"):
        A.generator_importance_weights(TRAINER, GENERATOR, MASK, "tokens", None, 3.0)


def test_weighted_sequence_log_probs_keep_the_value_and_weight_each_tokens_gradient():
    torch.manual_seed(0)
    logps = torch.randn(2, 3, requires_grad=True)
    w = torch.tensor([[0.5, 2.0, 3.0], [1.0, 0.0, 4.0]])
    weighted = A.importance_weighted_sequence_log_probs(logps, w, MASK)
    assert torch.equal(weighted, A.sequence_log_probs(logps, MASK))  # bit-equal: rho and its clip are unchanged
    weighted.sum().backward()
    torch.testing.assert_close(logps.grad, w * MASK)  # d/d logp_t = w_t on real tokens, 0 on padding


def test_a_sequence_weight_scales_the_clipped_losss_gradient_like_a_row_weight():
    """In the sequence loss, a (B, 1) weight gives the gradient of w_i * objective_i, clipped or not."""
    torch.manual_seed(1)
    logps = torch.randn(2, 3, requires_grad=True)
    old = (logps.detach() + torch.tensor([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0]]))  # row 1: rho = e^-0.5, clipped
    advantages, w = torch.tensor([1.0, -1.0]), torch.tensor([[2.5], [0.3]])
    old_seq = A.sequence_log_probs(old, MASK)
    loss, _ = A.clipped_sequence_loss(A.importance_weighted_sequence_log_probs(logps, w, MASK), old_seq, advantages,
                                      0.2, 0.2, normalizer=2.0)
    (grad,) = torch.autograd.grad(loss, logps)
    reference = logps.detach().clone().requires_grad_(True)
    ref_loss, _ = A.clipped_sequence_loss(A.sequence_log_probs(reference, MASK), old_seq, advantages, 0.2, 0.2,
                                          weights=w.squeeze(-1), normalizer=2.0)
    (ref_grad,) = torch.autograd.grad(ref_loss, reference)
    torch.testing.assert_close(grad, ref_grad)
    assert grad[1].abs().sum() == 0  # the clipped row has no gradient either way


def test_logprob_difference_stats_exclude_masked_tokens():
    stats = A.logprob_difference_stats(TRAINER, GENERATOR, MASK)
    assert stats["mean"].item() == pytest.approx((0.5 + 1.0 + 2.0 + 0.1 + 0.2) / 5)
    assert stats["max"].item() == pytest.approx(2.0)  # not the masked 9.0


def test_importance_weight_stats_over_tokens_or_sequences():
    token = A.importance_weight_stats(weights("token_truncate", clip_min=0.5), MASK)
    assert [token[k].item() for k in ("min", "max")] == pytest.approx([0.5, 3.0])  # the masked 0 is not a token
    assert token["mean"].item() == pytest.approx((math.exp(0.5) + 0.5 + 3.0 + math.exp(0.1) + math.exp(0.2)) / 5)
    sequence = A.importance_weight_stats(weights("sequence_mask"), MASK)
    assert [sequence[k].item() for k in ("min", "mean", "max")] == pytest.approx(
        [0.0, math.exp(0.3) / 2, math.exp(0.3)])


def test_the_vllm_anchor_drops_masked_tokens_and_completions_from_the_sums_and_the_loss():
    rows = torch.tensor([1.0, 0.5])
    seq_mask, seq_rows = A.vllm_anchor_masks(weights("sequence_mask"), MASK, rows)  # row 0's weight e^1.5 > 3
    assert seq_mask.tolist() == [[0, 0, 0], [1, 1, 0]] and seq_rows.tolist() == [0.0, 0.5]
    tok_mask, tok_rows = A.vllm_anchor_masks(weights("token_mask", clip_min=0.5), MASK, rows)
    assert tok_mask.tolist() == [[1, 0, 0], [1, 1, 0]] and tok_rows.tolist() == [1.0, 0.5]


def test_against_vllms_log_probs_the_clip_bounds_the_step_from_the_sampling_policy():
    """rho = pi_theta / pi_vllm: on-policy for the trainer (pi_theta == pi_old) it equals the importance weight,
    so inside the clip the gradient is the weighted one, and a completion already past 1 + eps gets none."""
    logps = torch.zeros(2, 3, requires_grad=True)
    generator = torch.tensor([[-0.02, -0.02, -0.02], [-0.1, -0.1, 0.0]])  # rho e^0.06 (inside), e^0.2 (past 1.2)
    advantages = torch.tensor([1.0, 1.0])
    w = A.generator_importance_weights(logps.detach(), generator, MASK, "sequence_mask", None, 3.0)
    kept, rows = A.vllm_anchor_masks(w, MASK, torch.ones(2))
    loss, ratio = A.clipped_sequence_loss(A.sequence_log_probs(logps, kept), A.sequence_log_probs(generator, kept),
                                          advantages, 0.2, 0.2, rows, normalizer=2.0)
    torch.testing.assert_close(ratio, torch.exp(torch.tensor([0.06, 0.2])))
    (grad,) = torch.autograd.grad(loss, logps)
    torch.testing.assert_close(grad[0], -math.exp(0.06) / 2 * MASK[0].float())  # d(-rho A / 2) = -rho A / 2
    assert grad[1].abs().sum() == 0


def brute_force_kept_log_mass(logits: torch.Tensor, top_k=None, top_p=1.0, min_p=None) -> float:
    """One position, token by token, in vLLM's order: min_p, top_k (ties kept), top_p on the renormalised rest."""
    probs = logits.softmax(-1).tolist()
    kept = set(range(len(probs)))
    if min_p:
        kept = {i for i in kept if probs[i] >= min_p * max(probs)}
    if top_k:
        kth = sorted((probs[i] for i in kept), reverse=True)[min(top_k, len(kept)) - 1]
        kept = {i for i in kept if probs[i] >= kth}
    if top_p < 1.0:
        total = sum(probs[i] for i in kept)
        ascending = sorted(kept, key=lambda i: probs[i])
        below = 0.0
        for i in ascending[:-1]:  # the top token always stays
            below += probs[i] / total
            if below <= 1 - top_p:
                kept.discard(i)
            else:
                break
    return math.log(sum(probs[i] for i in kept))


@pytest.mark.parametrize("truncation", [dict(top_p=0.9), dict(top_k=3), dict(min_p=0.2), dict(top_k=5, top_p=0.7),
                                        dict(top_k=6, top_p=0.5, min_p=0.1)])
def test_sampling_kept_log_mass_is_the_log_of_what_vllms_truncation_keeps(truncation):
    torch.manual_seed(0)
    logits = torch.randn(4, 6, 12) * 2  # (B, T, V)
    kept = A.sampling_kept_log_mass(logits, **truncation)
    assert kept.shape == (4, 6) and (kept <= 0).all() and (kept < -1e-3).any()
    expected = torch.tensor([[brute_force_kept_log_mass(pos, **truncation) for pos in row] for row in logits])
    torch.testing.assert_close(kept, expected, atol=1e-6, rtol=0)


def test_sampling_kept_log_mass_is_zero_without_truncation():
    logits = torch.randn(3, 5, 9)
    assert torch.equal(A.sampling_kept_log_mass(logits), torch.zeros(3, 5))
    assert torch.equal(A.sampling_kept_log_mass(logits, top_k=9, top_p=1.0), torch.zeros(3, 5))


def test_with_the_kept_mass_added_back_a_truncated_sampler_gives_ratio_one_at_the_sampling_weights():
    """The defect: vLLM reports log mu_trunc = log pi - log Z. Taken as is, the sequence ratio at the sampling
    weights is prod_t Z_t (median 0.08 measured at top_p 0.9), so the clip removes most of the gradient."""
    torch.manual_seed(1)
    logits = torch.randn(8, 10, 50)
    tokens = logits.argmax(-1)  # kept under any truncation
    trainer, _ = A.token_log_probs(logits, tokens)
    kept = A.sampling_kept_log_mass(logits, top_p=0.9)
    vllm_reported = trainer - kept
    mask = torch.ones(8, 10)
    advantages = torch.tensor([1.0, -1.0] * 4)
    raw = A.sequence_log_probs(trainer, mask) - A.sequence_log_probs(vllm_reported, mask)
    assert raw.exp().max() < 0.9  # every row's rho far below 1 - epsilon
    _, ratio = A.clipped_sequence_loss(A.sequence_log_probs(trainer, mask),
                                       A.sequence_log_probs(vllm_reported + kept, mask), advantages, 0.2, 0.2)
    torch.testing.assert_close(ratio, torch.ones(8))
    assert A.clip_ratio_metrics(ratio, advantages, 0.2, 0.2)["region"] == 0
