"""One forward per distinct prompt, shared by its completions, gives the plain forward's log-probs and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rloo_engine.logprobs import completion_token_logps
from rloo_engine.prompt_sharing import prompt_groups


def grouped_batch(vocab: int, prompts: int = 3, g: int = 4, prompt_len: int = 9, completion_len: int = 7):
    """rows [k*g, (k+1)*g) share prompt k; prompt 1 is left-padded; completions end at different lengths."""
    torch.manual_seed(0)
    prompt = torch.randint(3, vocab, (prompts, prompt_len))
    prompt_mask = torch.ones_like(prompt)
    prompt[1, :4], prompt_mask[1, :4] = 0, 0
    completion = torch.randint(3, vocab, (prompts * g, completion_len))
    completion_mask = torch.ones_like(completion)
    for row in range(prompts * g):
        completion_mask[row, completion_len - row % 3:] = 0
    ids = torch.cat([prompt.repeat_interleave(g, 0), completion], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(g, 0), completion_mask], 1)
    return ids, mask, prompt_len


def test_prompt_groups_finds_runs_of_the_same_prompt():
    ids = torch.tensor([[1, 2], [1, 2], [3, 4], [1, 2], [1, 2], [1, 2]])
    mask = torch.ones_like(ids)
    firsts, inverse = prompt_groups(ids, mask)
    assert firsts.tolist() == [0, 2, 3] and inverse.tolist() == [0, 0, 1, 2, 2, 2]
    mask[1, 0] = 0  # same tokens, other padding: another prompt
    assert prompt_groups(ids, mask)[1].tolist() == [0, 1, 2, 3, 3, 3]
    assert prompt_groups(ids[1:3], mask[1:3]) is None  # nothing shared, nothing to save
    assert prompt_groups(ids[:1], mask[:1]) is None


@pytest.fixture(scope="module", params=["qwen2_model", "llama_model"])
def model(request):
    return AutoModelForCausalLM.from_pretrained(request.getfixturevalue(request.param), dtype=torch.float32)


@pytest.mark.parametrize("chunked", [False, True])
def test_shared_prompts_give_the_plain_forwards_values_entropy_and_gradients(model, chunked):
    ids, mask, P = grouped_batch(model.config.vocab_size)
    weights = torch.randn(ids.size(0), ids.size(1) - P)
    results = {}
    for share in (False, True):
        model.zero_grad()
        calls = []
        handle = model.model.layers[0].register_forward_hook(lambda m, a, out, seen=calls: seen.append(a[0].shape[:2]))
        try:
            logps, entropy = completion_token_logps(model, ids, mask, P, 0.7, with_entropy=True, chunked=chunked,
                                                    share_prompts=share)
        finally:
            handle.remove()
        (logps * weights * mask[:, P:]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share] = (logps.detach(), entropy, grads, calls)
    (want, want_entropy, want_grads, plain_calls), (got, got_entropy, got_grads, shared_calls) = results[False], results[True]
    # The last completion token predicts nothing scored, so neither path runs it.
    assert plain_calls == [(12, 15)]
    assert shared_calls == [(3, 9), (12, 6)]  # the 3 prompts once each, then the 12 completions on their caches
    real = mask[:, P:].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5)
    assert torch.allclose(got_entropy[real], want_entropy[real], atol=1e-4)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-5, rtol=1e-4), name


def test_rows_without_a_shared_prompt_take_the_plain_forward(model):
    ids, mask, P = grouped_batch(model.config.vocab_size, prompts=4, g=1)
    calls = []
    handle = model.model.layers[0].register_forward_hook(lambda m, a, out: calls.append(a[0].shape[:2]))
    try:
        with torch.no_grad():
            completion_token_logps(model, ids, mask, P, 1.0, share_prompts=True)
    finally:
        handle.remove()
    assert calls == [(4, 15)]


@pytest.mark.parametrize("arch", ["qwen2_model", "llama_model"])
def test_training_with_shared_prompts_matches_the_plain_forward(tmp_path, arch, request):
    """4 steps with a reference (beta > 0) and off-policy micro-batches, so every pass that shares runs."""
    from rloo_engine.trainer import RLOOTrainer
    from tests.engine.helpers import read_metrics, tiny_config

    model = request.getfixturevalue(arch)
    finals, metrics = {}, {}
    for share in (False, True):
        cfg = tiny_config(tmp_path / str(share), model, beta=0.05, num_iterations=2, share_prompt_forward=share)
        trainer = RLOOTrainer(cfg)
        assert trainer.share_prompts is share  # the probe found the shared path exact on this model
        trainer.train()
        finals[share] = AutoModelForCausalLM.from_pretrained(f"{cfg.output_dir}/final").state_dict()
        metrics[share] = read_metrics(cfg.output_dir)
    assert sum("kl" in row for row in metrics[True]) == 2  # generation batches, each trained on twice
    for plain, shared in zip(metrics[False], metrics[True]):
        assert plain.keys() == shared.keys()
        for key in {"reward", "kl", "loss", "grad_norm", "entropy", "clip_ratio/region_mean"} & plain.keys():
            assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), (plain["step"], key)
    moved = max((finals[False][k] - AutoModelForCausalLM.from_pretrained(model).state_dict()[k]).abs().max()
                for k in finals[False])
    gap = max((finals[True][k] - finals[False][k]).abs().max() for k in finals[False])
    assert gap < 1e-4 < moved  # rounding of other matmul shapes, far below what 4 steps move


def test_a_model_that_drops_the_cache_fails_loudly_never_scores_completions_without_their_prompt(qwen2_model):
    model = AutoModelForCausalLM.from_pretrained(qwen2_model, dtype=torch.float32)
    model.gradient_checkpointing_enable()  # in training mode with grad, transformers drops the KV cache
    model.train()
    ids, mask, P = grouped_batch(model.config.vocab_size)
    with pytest.raises(RuntimeError, match="share_prompt_forward: the completion pass did not run on the prompts"):
        completion_token_logps(model, ids, mask, P, 1.0, share_prompts=True)


@pytest.mark.parametrize("fixture", ["reward_model", "reward_model_other_tokenizer"])  # Qwen2, Llama
def test_a_decoder_reward_model_scores_shared_prompts_as_it_scores_whole_rows(fixture, request):
    from rloo_engine.reward_sources import RewardModelSource

    path = request.getfixturevalue(fixture)
    shared, plain = RewardModelSource(str(path), batch_size=5), RewardModelSource(str(path), share_prompts=False)
    assert shared.share_prompts and not plain.share_prompts
    prompts = ["the cat sat on the mat and", "a dog ran", "a dog ran"] + ["the bird sang"] * 4
    completions = [" the dog ran", " far away", " home", " a", " a song about the sea", "", " ok then"]
    calls = []
    handle = shared.model.base_model.layers[0].register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    try:
        got = shared(prompts, completions)
    finally:
        handle.remove()
    assert got == pytest.approx(plain(prompts, completions), abs=1e-5)
    # the lone prompt's row whole; then each run's prompt once and its rows (2 + 4 rows exceed batch_size 5)
    assert calls == [1, 1, 2, 1, 4]


def test_an_encoder_reward_model_scores_rows_whole(tmp_path, policy_tokenizer):
    from rloo_engine.reward_sources import RewardModelSource
    from rloo_engine.testing import tiny_models

    path = tiny_models.build_reward_model(tmp_path / "roberta", policy_tokenizer, arch="roberta", seed=3)
    rm = RewardModelSource(str(path))
    assert not rm.share_prompts  # bidirectional: a prompt's states depend on the completion, nothing to share
    prompts, completions = ["a dog ran"] * 2, [" far away", " home"]
    assert rm(prompts, completions) == pytest.approx(RewardModelSource(str(path), share_prompts=False)(prompts,
                                                                                                       completions))
