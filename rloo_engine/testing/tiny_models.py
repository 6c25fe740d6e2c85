"""Builds tiny, randomly initialised models and locally trained tokenizers, for tests and offline demos.

Nothing here downloads anything: tokenizers are trained with `tokenizers` on text generated
in-process, and models are random-init from a transformers config (`DECODER_CONFIGS`, or RoBERTa).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    RobertaConfig,
)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

# A ChatML-like template; enough to exercise conversational prompts end to end.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS = (
    "the a cat dog sat ran on under mat tree big small red blue green happy sad quick slow "
    "fox jumps over lazy river sun moon star bird sings song house garden apple pear good bad "
    "yes no please thank you summary text short long answer question what why how when where"
).split()


def synthetic_corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Returns `num_lines` pseudo-sentences over a small vocabulary (deterministic in `seed`)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(num_lines)]


def train_tokenizer(
    texts: list[str] | None = None,
    vocab_size: int = 320,
    style: str = "bpe",
    chat_template: str | None = CHAT_TEMPLATE,
    extra_specials: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """Trains a byte-level tokenizer on `texts` and wraps it for transformers.

    `style` is "bpe" (byte-level BPE) or "wordpiece"-like "unigram"; two styles give two
    genuinely different tokenizers over the same text (for the cross-tokenizer reward test).
    """
    texts = texts if texts is not None else synthetic_corpus()
    specials = [PAD, EOS, UNK, "<|user|>", "<|assistant|>", "<|system|>", *extra_specials]
    if style == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif style == "unigram":
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            unk_token=UNK,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        raise ValueError(f"style: {style!r}; expected 'bpe' or 'unigram'")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK)
    if chat_template:
        wrapped.chat_template = chat_template
    return wrapped


# The decoder-only config classes `lm_config` builds, by arch name (tiny_chat_models.FAMILIES shapes them like the
# released models: head size, sliding windows, rope scaling, soft-capping, experts).
DECODER_CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig,
                   "phi3": Phi3Config, "gemma2": Gemma2Config, "gemma3_text": Gemma3TextConfig,
                   "qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}


def lm_config(arch: str, vocab_size: int, pad_id: int, eos_id: int, hidden: int, layers: int, **extra):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        tie_word_embeddings=True,
    )
    common.update(extra)  # e.g. num_attention_heads: vLLM's CPU attention needs a head size of 32 or more
    if arch in DECODER_CONFIGS:
        return DECODER_CONFIGS[arch](**common)
    if arch == "roberta":
        # An encoder reward model: positions start after padding_idx (= pad id), as RoBERTa/XLM-R number them.
        for key in ("num_key_value_heads", "tie_word_embeddings"):
            common.pop(key)
        common["max_position_embeddings"] = 512 + pad_id + 2
        return RobertaConfig(**common, type_vocab_size=1)
    raise ValueError(f"arch: {arch!r}; expected one of {', '.join(DECODER_CONFIGS)} or 'roberta'")


def build_causal_lm(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    **config_fields,
) -> Path:
    """Saves a random-init causal LM (and its tokenizer) to `out_dir`; returns the path. `config_fields`
    override the config's (e.g. num_attention_heads)."""
    # a vocabulary larger than the tokenizer's, as real models pad theirs, sizes the head for benches
    vocab = config_fields.pop("vocab_size", len(tokenizer))
    cfg = lm_config(arch, vocab, tokenizer.pad_token_id, tokenizer.eos_token_id, hidden, layers, **config_fields)
    return save_random_init(AutoModelForCausalLM, cfg, tokenizer, out_dir, seed)


def save_random_init(auto_class, config, processing_class, out_dir: str | Path, seed: int = 0) -> Path:
    """`auto_class`'s random-init model of `config` (seeded), generating with the tokenizer's pad and EOS, saved with
    `processing_class` (a tokenizer or a processor) to `out_dir`."""
    torch.manual_seed(seed)
    model = auto_class.from_config(config)
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out = Path(out_dir)
    model.save_pretrained(out)
    processing_class.save_pretrained(out)
    return out


def build_reward_model(
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2",
    hidden: int = 32,
    layers: int = 2,
    num_labels: int = 1,
    seed: int = 0,
) -> Path:
    """Saves a random-init sequence classifier (`num_labels` outputs) with its tokenizer."""
    torch.manual_seed(seed)
    cfg = lm_config(
        arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, hidden, layers, num_labels=num_labels
    )
    model = AutoModelForSequenceClassification.from_config(cfg)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_prompt_file(path: str | Path, num_prompts: int = 64, seed: int = 0) -> Path:
    """Writes a jsonl prompt dataset of short synthetic prompts (standard format)."""
    import json

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    lines = synthetic_corpus(num_prompts, seed=seed + 100)
    p.write_text("".join(json.dumps({"prompt": " ".join(line.split()[:4])}) + "\n" for line in lines))
    return p


def tiny_assets_main(argv: list[str]) -> int:
    """`rloo-engine tiny-assets DIR`: a tiny policy + prompt file for `configs/tiny.yaml` (offline, seconds)."""
    from rloo_engine.argparsing import StrictArgumentParser

    parser = StrictArgumentParser(prog="rloo-engine tiny-assets", description=tiny_assets_main.__doc__)
    parser.add_argument("directory", nargs="?", default=".rloo-tiny")
    args = parser.parse_args(argv)
    root = Path(args.directory)
    tok = train_tokenizer()
    build_causal_lm(root / "policy", tok, arch="qwen2", hidden=64, layers=2)
    write_prompt_file(root / "prompts.jsonl")
    print(f"tiny assets written to {root}/ (policy/, prompts.jsonl)")
    return 0
