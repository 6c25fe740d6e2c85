"""The arithmetic of one RLOO step: model FLOPs per phase from the shapes, for the engine and for TRL.

`vs_trl.py` divides these by each phase's measured time and by a float32 matmul peak measured in the same run
(`matmul_peak`), and compares generation with `decode_matmul_ceiling`: the FLOP/s a decode step's matmuls reach at
the run's batch when their weights come from memory, which is what bounds decoding, not the peak.

Counting (useful model FLOPs, as in MFU; padding not counted, attention scores counted):
- a linear layer of n weights over t tokens: 2 n t; a forward+backward: 3x its forward.
- attention over causal pairs: 4 * attention_width * layers per (query, key) pair (QK^T and AV).
- the LM head runs only where a log-prob or a next token is needed: the completion positions.
- the engine forwards each distinct prompt once per group of G and reuses its KV for the G completions (generation,
  reward model, reference and update: `share_prompt_forward`); TRL forwards every row's prompt, and runs one more
  no-grad policy forward (its `old_per_token_logps`, computed whether or not `num_iterations` > 1).
The reward model is a same-shape decoder with a 1-output score head (no LM head) scoring the same tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """A Qwen2-shaped decoder: `body` = every weight a token's forward multiplies except the LM head."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def layer_weights(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        return qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def body(self) -> int:
        return self.layers * self.layer_weights

    @property
    def head(self) -> int:
        return self.hidden * self.vocab

    def attention(self, pairs: float) -> float:
        return 4.0 * self.heads * self.head_dim * self.layers * pairs


@dataclass(frozen=True)
class Tokens:
    """One optimizer step's tokens: `rows` completions in groups of `group`, prompts of `prompt` tokens, `completion`
    completion tokens in all (so `completion / rows` on average)."""

    rows: int
    group: int
    prompt: int
    completion: float

    @property
    def groups(self) -> float:
        return self.rows / self.group

    def pairs(self, shared_prompt: bool) -> float:
        """Causal (query, key) pairs: each prompt attends to itself (once per group when shared), each completion token
        to its prompt and the completion tokens before it (length c per row taken as the mean)."""
        prompts = (self.groups if shared_prompt else self.rows) * self.prompt * (self.prompt + 1) / 2
        c = self.completion / self.rows
        return prompts + self.rows * (c * self.prompt + c * (c + 1) / 2)


def forward(shape: Shape, tokens: Tokens, shared_prompt: bool, lm_head: bool = True) -> float:
    """One forward over every row's prompt + completion, LM head on the completion positions."""
    prompt_tokens = (tokens.groups if shared_prompt else tokens.rows) * tokens.prompt
    body = 2.0 * shape.body * (prompt_tokens + tokens.completion)
    return body + (2.0 * shape.head * tokens.completion if lm_head else 0.0) + shape.attention(
        tokens.pairs(shared_prompt))


def engine_phases(shape: Shape, t: Tokens, reference_forwards: int = 1) -> dict[str, float]:
    """FLOPs of the engine's phases (the names of its `timing/*_s` metrics). `reference_forwards`: 1 when the
    policy's log-probs come from decoding (beta > 0), 2 when a policy forward adds them, 0 at beta 0."""
    shared = forward(shape, t, shared_prompt=True)
    return {
        "generation": shared,  # prefill once per group + one decode step per completion token, head on each
        "reward": forward(shape, t, shared_prompt=True, lm_head=False),
        "reference": reference_forwards * shared,
        "policy_update": 3.0 * shared,
    }


def trl_phases(shape: Shape, t: Tokens, beta: float) -> dict[str, float]:
    """FLOPs of the same step in TRL 1.16's RLOOTrainer: every row's prompt, and the old-log-prob policy forward."""
    whole = forward(shape, t, shared_prompt=False)
    return {
        "generation": whole,
        "reward": forward(shape, t, shared_prompt=False, lm_head=False),
        "reference": (2.0 if beta else 1.0) * whole,  # old_per_token_logps (+ the reference model's at beta != 0)
        "policy_update": 3.0 * whole,
    }


def matmul_peak(size: int = 2048, seconds: float = 2.0, dtype: torch.dtype = torch.float32) -> float:
    """Sustained FLOP/s of back-to-back `size` x `size` matmuls on this process's threads (CPU)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        calls += 1
    return 2.0 * size**3 * calls / (time.perf_counter() - start)


def decode_matmul_ceiling(shape: Shape, batch: int, steps: int = 8) -> float:
    """FLOP/s of one decode step's matmuls alone at `batch` rows (packed q/k/v and gate/up as the fused decoder runs
    them, then the LM head), every layer its own weights as in the model, so they stream from memory each step."""
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    weights = [(torch.randn(shape.hidden, qkv), torch.randn(shape.heads * shape.head_dim, shape.hidden),
                torch.randn(shape.hidden, 2 * shape.intermediate), torch.randn(shape.intermediate, shape.hidden))
               for _ in range(shape.layers)]
    head = torch.randn(shape.hidden, shape.vocab)
    x = torch.randn(batch, shape.hidden)

    def step() -> None:
        for qkv_w, o_w, gate_up_w, down_w in weights:
            x @ qkv_w
            x @ o_w
            (x @ gate_up_w)[:, : shape.intermediate] @ down_w
        x @ head

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    seconds = (time.perf_counter() - start) / steps
    return 2.0 * batch * (shape.body + shape.head) / seconds
