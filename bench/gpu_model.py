"""Builds the GPU check's offline assets: a random-init ~0.5B Qwen2-shaped policy (Qwen2.5-0.5B's shape) and prompts.

Nothing is downloaded: the tokenizer is trained on generated text; the vocabulary is padded to
151,936 rows as Qwen2.5's is, so the LM head and log-prob memory are those of the real model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rloo_engine.testing import tiny_models


def build(out: Path) -> Path:
    tok = tiny_models.train_tokenizer(vocab_size=2000)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    print(f"gpu_model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters -> {out}")
    model.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    tiny_models.write_prompt_file(out / "prompts.jsonl", num_prompts=256)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]))
