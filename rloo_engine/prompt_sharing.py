"""One forward over each distinct prompt, shared by its G completions (`share_prompt_forward`).

A generation batch holds every prompt G times: rows [k*G, (k+1)*G) repeat prompt k. A plain forward over
(prompt + completion) computes each prompt's activations G times. Here the prompt tokens run once per distinct
prompt with `use_cache=True`; their KV cache is indexed out to every row (an index, so under autograd each
prompt's gradient is the sum over its rows), and the completion tokens run on top of it. Same function, fewer
FLOPs: the saving is (G-1)/G of the prompt tokens' share of the sequence, in the no-grad log-prob passes and in
the training forward and backward.
"""

from __future__ import annotations

import torch

from rloo_engine.generation.kv_cache import cache_keyword


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(firsts (U,), inverse (B,)): the first row of each run of adjacent rows with the same prompt, and each
    row's run; None when no two adjacent rows share one (nothing to save). prompt_ids, prompt_mask: (B, P)."""
    if prompt_ids.size(0) < 2:
        return None
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)  # (B-1,)
    if not bool(same.any()):
        return None
    starts = torch.cat([same.new_ones(1), ~same])  # (B,) a new prompt begins here
    return starts.nonzero().squeeze(-1), starts.long().cumsum(0) - 1


def _base(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP / DeepSpeed / PEFT wrappers (its config and forward signature)."""
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def shared_prompt_outputs(model, run, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor, prompt_length: int,
                          groups: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """What `run(model, **forward kwargs)` returns (logits or the LM head's input, (B, positions, .)) for the T
    positions that predict the completion tokens, with the prompt computed once per distinct prompt: two pieces
    along the positions, the last prompt position's (B, 1, .) and the completion's first T - 1 (B, T - 1, .)."""
    from transformers import DynamicCache

    firsts, inverse = groups
    P = prompt_length
    cache = DynamicCache(config=_base(model).config)
    cache_arg = {cache_keyword(_base(model)): cache}
    # The last prompt position predicts the first completion token: keep only it (logits_to_keep=1). The prompt
    # pass skips a DDP / DeepSpeed wrapper: a wrapper's second forward before one backward fails its reducer,
    # and the parameters' gradient hooks fire all the same.
    last = run(getattr(model, "module", model), input_ids=input_ids[firsts, :P],
               attention_mask=attention_mask[firsts, :P], position_ids=position_ids[firsts, :P], use_cache=True,
               logits_to_keep=1, **cache_arg)
    T = input_ids.size(1) - P
    if T == 1:
        return [last[inverse]]
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...), differentiable
    # The completion but its last token, which predicts nothing scored: positions P .. P+T-2.
    end = P + T - 1
    rest = run(model, input_ids=input_ids[:, P:end], attention_mask=attention_mask[:, :end],
               position_ids=position_ids[:, P:end], use_cache=True, logits_to_keep=T - 1, **cache_arg)
    if cache.get_seq_length() != end:  # e.g. gradient checkpointing drops the cache in training mode
        raise RuntimeError(f"share_prompt_forward: the completion pass did not run on the prompts' KV cache (it "
                           f"holds {cache.get_seq_length()} positions, expected {end}); gradient checkpointing? "
                           "set share_prompt_forward: false")
    return [last[inverse], rest]  # positions P-1, then P .. P+T-2


# ---------------------------------------------------------------- reward models
def common_prefix_length(rows: list[list[int]]) -> int:
    """Tokens every row of a run starts with, leaving each row at least one of its own (the score is read there)."""
    shortest = min(map(len, rows))
    length = 0
    while length < shortest - 1 and all(row[length] == rows[0][length] for row in rows):
        length += 1
    return length


@torch.inference_mode()
def shared_prefix_scores(model, pad_id: int, rows: list[list[int]], runs: list[range]) -> torch.Tensor | None:
    """(len(rows),) a decoder reward model's score at each row's last token, each run's common token prefix run
    once. `runs`: consecutive row ranges that share a prompt. The prefixes are left-padded, the rest right-padded,
    positions counted over real tokens, so each token keeps the position it has unpadded."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    base = _base(model)
    lengths = [common_prefix_length(rows[r.start:r.stop]) for r in runs]
    if not max(lengths):
        return None  # nothing in common: the caller scores the rows whole
    inverse = torch.tensor([k for k, r in enumerate(runs) for _ in r], device=device)
    width = max(lengths)
    prefix = torch.tensor([[pad_id] * (width - n) + rows[r.start][:n] for r, n in zip(runs, lengths)], device=device)
    prefix_mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)
    tails = [rows[i][n:] for r, n in zip(runs, lengths) for i in r]
    tail_width = max(map(len, tails))
    tail = torch.tensor([t + [pad_id] * (tail_width - len(t)) for t in tails], device=device)
    tail_mask = torch.tensor([[1] * len(t) + [0] * (tail_width - len(t)) for t in tails], device=device)
    decoder = base.base_model
    cache = DynamicCache(config=base.config)
    cache_arg = {cache_keyword(decoder): cache}
    decoder(input_ids=prefix, attention_mask=prefix_mask, position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True, **cache_arg)
    cache.batch_select_indices(inverse)
    positions = prefix_mask.sum(-1)[inverse].unsqueeze(-1) + torch.arange(tail_width, device=device)
    hidden = decoder(input_ids=tail, attention_mask=torch.cat([prefix_mask[inverse], tail_mask], 1),
                     position_ids=positions, use_cache=True, **cache_arg).last_hidden_state
    if cache.get_seq_length() != width + tail_width:
        raise RuntimeError("reward model: the completions did not run on the shared prompt's KV cache")
    last = tail_mask.sum(-1) - 1
    return base.score(hidden[torch.arange(len(tails), device=device), last]).float()[:, 0]
