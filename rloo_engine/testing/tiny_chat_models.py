"""Tiny offline models shaped like the chat models users train: their special tokens, templates, BOS and EOS lists.

- `qwen`: ChatML template (`<|im_start|>role ... <|im_end|>`), no BOS, tokenizer EOS `<|im_end|>`,
  `generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]` (as Qwen2.5-Instruct).
- `llama3`: header template that starts with `{{ bos_token }}`, a tokenizer that adds BOS to plain
  text (`add_bos_token`), tokenizer EOS `<|eot_id|>`, and three end ids in `generation_config.json`
  (`<|end_of_text|>`, `<|eom_id|>`, `<|eot_id|>`, as Llama-3.1-Instruct).
Weights are random; `attention_dropout` is configurable so dropout handling can be tested.
"""

from __future__ import annotations

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
STYLES = {
    "qwen": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
                 pad="<|endoftext|>", end_ids=["<|im_end|>", "<|endoftext|>"], template=QWEN_TEMPLATE),
    "llama3": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eom_id|>", "<|eot_id|>"], bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None,
                   end_ids=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], template=LLAMA3_TEMPLATE),
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


def build_chat_model(out_dir: str | Path, style: str, attention_dropout: float = 0.0, seed: int = 0,
                     hidden: int = 32, **config_fields) -> Path:
    """Saves a random-init Qwen2- or Llama-shaped chat model with its tokenizer; returns the path. `config_fields`
    override the config's (e.g. num_attention_heads: vLLM's CPU attention needs a head size of at least 32)."""
    tok = chat_tokenizer(style)
    end_ids = [tok.convert_tokens_to_ids(t) for t in STYLES[style]["end_ids"]]
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    arch = "qwen2" if style == "qwen" else "llama"
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
