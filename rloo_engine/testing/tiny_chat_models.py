"""Tiny offline models shaped like the chat models users train: their special tokens, templates, BOS and EOS lists.

- `qwen`: ChatML template (`<|im_start|>role ... <|im_end|>`), no BOS, tokenizer EOS `<|im_end|>`,
  `generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]` (as Qwen2.5-Instruct).
- `llama3`: header template that starts with `{{ bos_token }}`, a tokenizer that adds BOS to plain
  text (`add_bos_token`), tokenizer EOS `<|eot_id|>`, and three end ids in `generation_config.json`
  (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`, as Llama-3.1-Instruct).
- `gemma`: `<start_of_turn>user|model ... <end_of_turn>` after `{{ bos_token }}`, BOS added to plain text, tokenizer
  EOS `<eos>`, end ids `<eos>` and `<end_of_turn>` (as Gemma-2/3-it).
- `phi3`: `<|user|> ... <|end|>`, no BOS, tokenizer EOS and pad `<|endoftext|>`, end ids `<|endoftext|>`,
  `<|assistant|>` and `<|end|>` (as Phi-3-mini-instruct).
- `mistral`: `[INST] ... [/INST]` after `{{ bos_token }}`, BOS added to plain text, EOS `</s>`, no pad token (as
  Mistral-7B-Instruct-v0.3).

`FAMILIES` pairs a style with a config class and the fields that make a tiny model shaped like the released one
(rope scaling, head size apart from hidden / heads, q/k norms, sliding windows, soft-capping, experts);
`build_family_model` saves one. Weights are random; `attention_dropout` is configurable so dropout handling can be
tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from rloo_engine.testing.tiny_models import lm_config, synthetic_corpus

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
STYLES = {
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                 pad="<|endoftext|>", end_ids=["<|im_end|>", "<|endoftext|>"], template=QWEN_TEMPLATE),
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
                   end_ids=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], template=LLAMA3_TEMPLATE),
    "gemma": dict(specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], bos="<bos>", eos="<eos>",
                  pad="<pad>", end_ids=["<eos>", "<end_of_turn>"], template=GEMMA_TEMPLATE),
    "phi3": dict(specials=["<|endoftext|>", "<|assistant|>", "<|user|>", "<|system|>", "<|end|>"], bos=None,
                 eos="<|endoftext|>", pad="<|endoftext|>", end_ids=["<|endoftext|>", "<|assistant|>", "<|end|>"],
                 template=PHI3_TEMPLATE),
    "mistral": dict(specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>", pad=None,
                    end_ids=["</s>"], template=MISTRAL_TEMPLATE),
}


@dataclass(frozen=True)
class Family:
    """A released model family in miniature: its chat style, `tiny_models.DECODER_CONFIGS` arch and config fields."""

    style: str
    arch: str
    fields: dict = field(default_factory=dict)


_GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)  # a window shorter than prompt + completion
_MOE = dict(num_experts_per_tok=2, output_router_logits=False, router_aux_loss_coef=0.01)
FAMILIES = {
    # Llama-3.1's rope scaling, its original context cut to 64 positions so the tiny head's frequencies are rescaled
    "llama3": Family("llama3", "llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen3": Family("qwen", "qwen3", dict(head_dim=16)),  # q/k RMSNorm per head; 4 x 16 != hidden, as Qwen3's
    "gemma2": Family("gemma", "gemma2", _GEMMA),  # alternating sliding/full layers, attention and logit soft-caps
    "gemma3": Family("gemma", "gemma3_text", dict(**_GEMMA, layer_types=["sliding_attention", "full_attention"],
                                                  rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "phi3": Family("phi3", "phi3"),  # packed qkv_proj and gate_up_proj
    "mistral": Family("mistral", "mistral", dict(sliding_window=None)),  # v0.3: no sliding window
    "qwen2_moe": Family("qwen", "qwen2_moe", dict(**_MOE, num_experts=4, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32)),
    "qwen3_moe": Family("qwen", "qwen3_moe", dict(**_MOE, head_dim=16, num_experts=4, moe_intermediate_size=32)),
    "mixtral": Family("mistral", "mixtral", dict(**_MOE, num_local_experts=4, sliding_window=None)),
}


def chat_tokenizer(style: str, vocab_size: int = 320) -> PreTrainedTokenizerFast:
    s = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(synthetic_corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=s["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    if s["bos"]:  # plain text gets BOS from the tokenizer, as Llama-3's does
        bos_id = tok.token_to_id(s["bos"])
        tok.post_processor = processors.TemplateProcessing(single=f"{s['bos']} $A", pair=f"{s['bos']} $A $B",
                                                           special_tokens=[(s["bos"], bos_id)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=s["bos"], eos_token=s["eos"],
                                      pad_token=s["pad"])
    wrapped.chat_template = s["template"]
    return wrapped


def build_family_model(out_dir: str | Path, family: str, seed: int = 0, **config_fields) -> Path:
    """Saves a random-init model of `FAMILIES[family]` (hidden 32, 2 layers) with its chat tokenizer."""
    f = FAMILIES[family]
    return build_chat_model(out_dir, f.style, seed=seed, arch=f.arch, **{**f.fields, **config_fields})


def build_chat_model(out_dir: str | Path, style: str, attention_dropout: float = 0.0, seed: int = 0,
                     hidden: int = 32, arch: str | None = None, **config_fields) -> Path:
    """Saves a random-init chat model with its tokenizer; returns the path. `arch` defaults to Qwen2 for the `qwen`
    style and Llama for the rest; `config_fields` override the config's (e.g. num_attention_heads: vLLM's CPU
    attention needs a head size of at least 32)."""
    tok = chat_tokenizer(style)
    end_ids = [tok.convert_tokens_to_ids(t) for t in STYLES[style]["end_ids"]]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    arch = arch or ("qwen2" if style == "qwen" else "llama")
    torch.manual_seed(seed)
    cfg = lm_config(arch, len(tok), pad_id, tok.eos_token_id, hidden, 2, attention_dropout=attention_dropout,
                    **config_fields)
    if tok.bos_token_id is not None:
        cfg.bos_token_id = tok.bos_token_id
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.eos_token_id = end_ids
    model.generation_config.bos_token_id = cfg.bos_token_id
    model.generation_config.pad_token_id = pad_id
    out = Path(out_dir)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
