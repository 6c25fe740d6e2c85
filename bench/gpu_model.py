"""Builds the GPU check's offline assets: a random-init Qwen2-shaped policy and a prompt file.

`--size 0.5b` (the GPU run) has Qwen2.5-0.5B's shape, its vocabulary padded to 151,936 rows as Qwen2.5's is, so
the LM head and log-prob memory are those of the real model. `--size tiny` (the `--cpu` run of bench/gpu_check.sh)
is the same code path on a model that trains in seconds on CPU. Nothing is downloaded: the tokenizer is trained
on generated text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rloo_engine.testing import tiny_models

EOS_SHARE = 40  # one id in this many ends a completion
SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048),
    "tiny": dict(vocab_size=2000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def build(out: Path, size: str) -> Path:
    tok = tiny_models.train_tokenizer(vocab_size=2000)
    cfg = Qwen2Config(**SHAPES[size], tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    # EOS reachable: at random init the one EOS id has probability ~1/vocab per token, so every completion would run
    # to the length limit, every length-based reward would tie and every advantage be 0. Listing 1/40 of the ids as
    # EOS (generation_config allows several) ends most completions early, at different lengths.
    stop_ids = range(cfg.vocab_size - cfg.vocab_size // EOS_SHARE, cfg.vocab_size)
    model.generation_config.eos_token_id = [tok.eos_token_id, *stop_ids]
    print(f"gpu_model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters ({size}) -> {out}")
    model.save_pretrained(out / "policy")
    tok.save_pretrained(out / "policy")
    tiny_models.write_prompt_file(out / "prompts.jsonl", num_prompts=256)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted(SHAPES), default="0.5b")
    args = parser.parse_args()
    build(args.out, args.size)
