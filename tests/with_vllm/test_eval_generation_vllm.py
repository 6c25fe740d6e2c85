"""`evaluation.generation.backend: vllm`: offline vLLM's greedy eval completions equal HF `generate`'s (fp32), with
the same prompts (plain and chat-templated, left-truncated) and the same stop ids (several EOS ids)."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from rloo_engine.evaluation.config import EvalGenerationConfig
from rloo_engine.evaluation.data import EvalPrompt, prompt_id
from rloo_engine.evaluation.generate import encode_prompts, generate_completions
from rloo_engine.testing import tiny_models


def test_vllm_greedy_completions_equal_hf_generate(vllm_policy, tmp_path):
    texts: list = [" ".join(line.split()[:6]) for line in tiny_models.synthetic_corpus(6, seed=11)]
    texts += [[{"role": "user", "content": "the cat sat"}], "the dog " * 20]  # templated; truncated from the left
    prompts = [EvalPrompt(prompt_id(t), t) for t in texts]
    gen = EvalGenerationConfig(max_new_tokens=10, max_prompt_length=24, batch_size=4)
    one_eos = generate_completions(str(vllm_policy), prompts, gen, field="policy_model_path", progress=False)

    # A second EOS id, a token HF's greedy completions produce mid-way: both backends must stop at it.
    tok = AutoTokenizer.from_pretrained(vllm_policy)
    first_ids = [tok(c, add_special_tokens=False)["input_ids"] for c in one_eos.values()]
    stop = next(ids[2] for ids in first_ids if len(ids) > 3)
    model = shutil.copytree(vllm_policy, tmp_path / "two_eos")
    generation_config = json.loads((model / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [tok.eos_token_id, stop]
    (model / "generation_config.json").write_text(json.dumps(generation_config))

    hf = generate_completions(str(model), prompts, gen, field="policy_model_path", progress=False)
    vllm = generate_completions(str(model), prompts, gen.model_copy(update={"backend": "vllm"}),
                                field="policy_model_path", progress=False)
    assert vllm == hf
    assert any(len(hf[k]) < len(one_eos[k]) for k in hf)  # some stopped at the second EOS id
    assert len(encode_prompts(tok, prompts[-1:], gen)[0]) == 24
