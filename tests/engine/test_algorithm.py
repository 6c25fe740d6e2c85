"""RLOO math: hand-computed small cases and brute-force float64 references."""

import math

import pytest
import torch

from rloo_engine import algorithm as A


def brute_token_logps(logits, tokens, temperature):
    """float64 reference: full log_softmax, then index."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_token_log_probs_match_float64_reference(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    tokens = torch.randint(0, 11, (3, 5))
    logps, entropy = A.token_log_probs(logits, tokens, temperature, with_entropy=True)
    torch.testing.assert_close(logps.double(), brute_token_logps(logits, tokens, temperature), atol=1e-5, rtol=0)
    p = torch.softmax(logits.double() / temperature, -1)
    ref_entropy = -(p * p.log()).sum(-1)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=0)


def test_token_log_probs_hand_computed():
    # two-token vocabulary, logits [0, ln 3]: p = [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    logps, _ = A.token_log_probs(logits, torch.tensor([[1]]))
    assert logps.item() == pytest.approx(math.log(0.75), abs=1e-6)


def test_token_log_probs_gradient_matches_reference():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 7, requires_grad=True)
    ref_logits = logits.detach().double().requires_grad_(True)
    tokens = torch.randint(0, 7, (2, 4))
    A.token_log_probs(logits, tokens, 0.9)[0].sum().backward()
    brute_token_logps(ref_logits, tokens, 0.9).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-5, rtol=0)


def test_sequence_log_probs_and_kl_respect_mask():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert A.sequence_log_probs(logps, mask).tolist() == [-3.0, -1.0]
    assert A.sequence_kl(logps, ref, mask).tolist() == [0.5, 1.0]


def test_the_kl_penalty_lowers_the_advantage_of_the_diverging_completion():
    # Equal rewards, one completion 4 nats from the reference, beta 0.5: its reward drops by 2, and the
    # leave-one-out baseline passes that on. Catches a flipped sign (+beta*kl) and a dropped term.
    rewards, kl = torch.ones(4), torch.tensor([0.0, 0.0, 0.0, 4.0])
    penalized = A.kl_penalized_rewards(rewards, kl, beta=0.5)
    assert torch.equal(penalized, torch.tensor([1.0, 1.0, 1.0, -1.0]))
    advantages = A.leave_one_out_advantages(penalized, num_generations=4)
    assert torch.allclose(advantages, torch.tensor([2 / 3, 2 / 3, 2 / 3, -2.0]))
    assert torch.equal(A.kl_penalized_rewards(rewards, kl, beta=0.0), rewards)


def test_leave_one_out_hand_computed():
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0])  # two prompts, G = 3
    adv = A.leave_one_out_advantages(rewards, 3)
    # prompt 0: baselines (2+3)/2, (1+3)/2, (1+2)/2
    expected = [1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 3.0, 0 - 3.0, 6 - 0.0]
    assert adv.tolist() == pytest.approx(expected)
    # leave-one-out advantages of a group sum to zero (G/(G-1) times centred rewards)
    assert adv.view(2, 3).sum(-1).tolist() == pytest.approx([0.0, 0.0])


def test_leave_one_out_brute_force_float64():
    torch.manual_seed(2)
    G, P = 4, 5
    rewards = torch.randn(P * G, dtype=torch.float64)
    valid = torch.rand(P * G) > 0.3
    adv = A.leave_one_out_advantages(rewards, G, valid)
    for i in range(P * G):
        group = range((i // G) * G, (i // G + 1) * G)
        others = [rewards[j].item() for j in group if j != i and valid[j]]
        expected = rewards[i].item() - sum(others) / len(others) if valid[i] and others else 0.0
        assert adv[i].item() == pytest.approx(expected, abs=1e-12)


def test_unscorable_rows_are_left_out_of_baseline():
    rewards = torch.tensor([1.0, 99.0, 3.0])
    valid = torch.tensor([True, False, True])
    assert A.leave_one_out_advantages(rewards, 3, valid).tolist() == [-2.0, 0.0, 2.0]
    # a lone valid row has nothing to compare with
    assert A.leave_one_out_advantages(rewards, 3, torch.tensor([True, False, False])).tolist() == [0.0, 0.0, 0.0]


def test_normalize_advantages_uses_every_scorable_row_as_trl_does():
    # A group whose rewards tie has advantage 0 but is scorable: TRL counts it in the std (the old code did not).
    adv = torch.tensor([2.0, -2.0, 0.0, 4.0, -4.0, 0.0])
    valid = torch.tensor([True, True, True, True, True, False])
    out = A.normalize_advantages(adv, valid, eps=0.0)
    live = adv[valid]
    assert torch.allclose(out[valid], (live - live.mean()) / live.std())
    assert out[[0, 1, 2, 3, 4]].std().item() == pytest.approx(1.0)
    assert out[5].item() == 0.0  # unscorable rows stay out of the loss


def test_normalize_advantages_takes_its_statistics_from_the_pooled_batch():
    """Each process normalises with the statistics of every process's rows (gathered), not its own."""
    mine, theirs = torch.tensor([1.0, -1.0]), torch.tensor([3.0, -3.0])
    pooled = torch.cat([mine, theirs])
    out = A.normalize_advantages(mine, torch.ones(2, dtype=torch.bool), pooled, torch.ones(4, dtype=torch.bool),
                                 eps=0.0)
    assert torch.allclose(out, (mine - pooled.mean()) / pooled.std())


def test_loss_normaliser_weighs_every_live_row_of_the_step_equally():
    """Two micro-batches of one optimizer step: 1 live row in the first, 4 in the second.

    Normalised per micro-batch, the lone row would get 4x the weight of the others; with the batch's
    normaliser (5 live rows / 2 micro-batches) each row's gradient is -A_i / 5 after accumulation.
    """
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    weights = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    seq = torch.zeros(8, requires_grad=True)
    normalizer = weights.sum().item() / 2
    total = 0
    for rows in (slice(0, 4), slice(4, 8)):
        loss, _ = A.clipped_sequence_loss(seq[rows], seq[rows].detach(), adv[rows], 0.2, 0.2, weights[rows],
                                          normalizer)
        total = total + loss / 2  # accelerate divides each micro-batch loss by the accumulation steps
    total.backward()
    assert torch.allclose(seq.grad, -weights / 5)


def test_clipped_loss_on_policy_is_reinforce():
    seq = torch.tensor([-3.0, -2.0], requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    loss, ratio = A.clipped_sequence_loss(seq, seq.detach(), adv, 0.2, 0.2)
    assert ratio.tolist() == [1.0, 1.0]
    loss.backward()
    # d/dlogp of -mean(rho * A) with rho = 1 is -A / B
    assert seq.grad.tolist() == pytest.approx([-0.75, 0.25])


def test_clipped_loss_clips_and_matches_brute_force():
    seq = torch.tensor([0.5, -0.5, 0.05, 0.3], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(4, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0], dtype=torch.float64)
    loss, ratio = A.clipped_sequence_loss(seq, old, adv, 0.2, 0.28)
    terms = []
    for lp, a in zip(seq.tolist(), adv.tolist()):
        rho = math.exp(lp)
        terms.append(min(rho * a, min(max(rho, 0.8), 1.28) * a))
    assert loss.item() == pytest.approx(-sum(terms) / 4)
    loss.backward()
    # row 0 (rho=1.65 > 1.28, A>0) and row 1 (rho=0.61 < 0.8, A<0) are clipped: no gradient
    assert seq.grad[0].item() == 0.0 and seq.grad[1].item() == 0.0
    # row 3 (rho=1.35, A<0): the unclipped term is the min, gradient flows
    assert seq.grad[3].item() != 0.0
    m = A.clip_ratio_metrics(ratio, adv, 0.2, 0.28)
    assert m["low"].item() == pytest.approx(0.25) and m["high"].item() == pytest.approx(0.25)
    assert m["region"].item() == pytest.approx(0.5)


def test_loss_weights_exclude_sequences():
    seq = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, _ = A.clipped_sequence_loss(seq, seq.detach(), torch.tensor([2.0, 5.0]), 0.2, 0.2, torch.tensor([1.0, 0.0]))
    loss.backward()
    assert loss.item() == pytest.approx(-2.0) and seq.grad.tolist() == pytest.approx([-2.0, 0.0])


def test_completion_mask_after_first_eos():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    mask, terminated = A.completion_mask(ids, eos_token_id=1)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert terminated.tolist() == [True, False, True]
    mask2, _ = A.completion_mask(ids, eos_token_id=[7, 1])
    assert mask2[1].tolist() == [1, 1, 1, 0]
