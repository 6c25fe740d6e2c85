"""The inverse-CDF sampler draws from exactly the distribution HF's multinomial sampling would."""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from rloo_engine.generation.sampling import TokenSampler, sample_categorical


def _frequencies(draws: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(draws, minlength=vocab).double() / draws.numel()


def _assert_matches(freq: torch.Tensor, probs: torch.Tensor, n: int) -> None:
    """Pearson chi-square over the tokens expected >= 5 times, the rest pooled; fails at p < 1e-4."""
    expected, observed = probs.double() * n, freq * n
    big = expected >= 5
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    keep = exp > 0
    statistic = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert scipy.stats.chi2.sf(statistic, int(keep.sum()) - 1) > 1e-4, statistic


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    torch.manual_seed(0)
    vocab, n = 1000, 100_000  # not a multiple of the 256-token block
    probs = torch.rand(vocab).pow(4)
    probs[torch.rand(vocab) < 0.3] = 0.0
    probs[-1] = 0.05  # mass in the padded last block
    probs = probs / probs.sum()
    draws = sample_categorical(probs.float().expand(n, vocab).contiguous())
    freq = _frequencies(draws, vocab)
    assert freq[probs == 0].sum() == 0
    _assert_matches(freq, probs.double(), n)


def test_unnormalised_rows_and_single_token_rows():
    probs = torch.zeros(4, 600)
    probs[0, 0] = 3.0  # all mass on the very first token
    probs[1, 599] = 0.2  # ... on the very last (padded block)
    probs[2, 255], probs[2, 256] = 1.0, 1.0  # the two sides of a block boundary
    probs[3] = 7.0
    for _ in range(200):
        draws = sample_categorical(probs)
        assert draws[0] == 0 and draws[1] == 599 and draws[2] in (255, 256) and 0 <= draws[3] < 600


def test_token_sampler_applies_temperature_and_top_k_as_hf_sampling_does():
    torch.manual_seed(1)
    vocab, n = 50, 40_000
    logits = torch.randn(vocab) * 2
    sampler = TokenSampler(temperature=0.7, top_k=5, top_p=1.0, min_p=None)
    scores = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, vocab).clone())
    assert torch.all(torch.isinf(scores).sum(-1) == vocab - 1)  # exactly one finite score per row
    draws = scores.argmax(-1)
    top = logits.topk(5).indices
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[top] = torch.softmax(logits[top].double() / 0.7, -1)
    _assert_matches(_frequencies(draws, vocab), expected, n)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0, -6.0]])
    sampler = TokenSampler(temperature=1.0, top_k=None, top_p=0.8, min_p=None)
    kept = set()
    for _ in range(300):
        kept.add(int(sampler(torch.zeros(1, 1, dtype=torch.long), logits.clone()).argmax()))
    assert kept == {0, 1}  # p = 0.66, 0.24, 0.09, ...: the first two reach 0.8


def test_the_models_own_generation_config_adds_no_second_temperature_or_top_k(qwen2_model):
    """Real chat models ship sampling defaults (Qwen2.5: temperature 0.7, top_k 20, top_p 0.8); the engine's
    sampling parameters replace them, as they did when HF sampled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rloo_engine.generation.base import SamplingParams
    from rloo_engine.generation.hf import HFGenerationBackend

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(qwen2_model)
    model.generation_config.update(do_sample=True, temperature=0.05, top_k=3, top_p=0.5, repetition_penalty=1.5)
    tok = AutoTokenizer.from_pretrained(qwen2_model)
    backend = HFGenerationBackend(lambda: model, tok, SamplingParams(1, temperature=1.0), record_logps=True)
    rollout = backend.generate(["the cat sat on"], 2000)
    first = rollout.completion_ids[:, 0]
    logits = model(**tok(["the cat sat on"], return_tensors="pt")).logits[0, -1].detach()
    probs = torch.softmax(logits.double(), -1)  # temperature 1, no top-k/top-p: the engine's parameters
    _assert_matches(_frequencies(first, probs.numel()), probs, first.numel())
    assert first.unique().numel() > 3  # the model's top_k=3 did not apply
    assert torch.allclose(rollout.sampling_logps[:, 0], probs.log()[first].float(), atol=1e-5)


@pytest.mark.parametrize(
    "bad_row",
    [torch.full((1000,), float("nan")), torch.zeros(1000), torch.tensor([float("inf")] + [0.1] * 999)],
    ids=["nan", "all-zero", "inf"],
)
def test_a_row_with_nan_inf_or_no_mass_is_refused_by_name(bad_row):
    probs = torch.stack([torch.full((1000,), 1e-3), bad_row, torch.full((1000,), 1e-3)])
    with pytest.raises(ValueError, match=r"probability rows \[1\] of 3 contain NaN or inf or sum to 0"):
        sample_categorical(probs)
    with pytest.raises(RuntimeError):  # torch.multinomial refuses the same rows
        torch.multinomial(probs, 1)
