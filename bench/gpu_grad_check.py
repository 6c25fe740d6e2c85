"""The GPU check's gradient part (bench/gpu_check.sh): the step-1 RLOO gradient of one fixed batch, through the
engine's own log-prob and loss functions, compared across the ways training runs.

A fixed batch (random prompt and completion tokens, fixed rewards, leave-one-out advantages, on-policy ratio 1)
makes the comparison exact in intent: sampled completions would differ between fp32 and bf16 and hide a broken
update behind sampling noise. First the reference, fp32 in one process without DeepSpeed (`--save`); then each
variant compares its full gradient with it (`--compare`): bf16 mixed precision (accelerate's autocast over fp32
weights, as `bf16: true` trains) and ZeRO-3 (under `accelerate launch --config_file deepspeed_zero3.yaml`, each
parameter's gradient gathered with `deepspeed.utils.safe_get_full_grad`). The last line is a JSON result; the
exit status is 1 when the gradient is zero or outside TOLERANCES.

    python bench/gpu_grad_check.py MODEL_DIR --save ref.safetensors
    python bench/gpu_grad_check.py MODEL_DIR --compare ref.safetensors --bf16
    accelerate launch --config_file deployments/accelerate/deepspeed_zero3.yaml --num_processes 1 \\
        bench/gpu_grad_check.py MODEL_DIR --compare ref.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rloo_engine import algorithm as A
from rloo_engine.config import RLOOConfig
from rloo_engine.distributed import build_accelerator, fill_deepspeed_config, is_deepspeed
from rloo_engine.logprobs import completion_token_logps

# cosine similarity with the fp32 gradient, and |norm / fp32 norm - 1|. bf16 rounds the forward's activations
# (~3 significant digits); ZeRO-3 in fp32 only reorders the reductions.
TOLERANCES = {"bf16": (0.99, 0.05), "zero3": (0.9999, 1e-3), "zero3-bf16": (0.99, 0.05)}
PROMPTS, G, PROMPT_TOKENS, COMPLETION_TOKENS = 2, 4, 16, 32


def fixed_batch(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (B, P + T), advantages (B,)): the same on every run (its own generator)."""
    gen = torch.Generator().manual_seed(1234)
    prompts = torch.randint(3, vocab, (PROMPTS, PROMPT_TOKENS), generator=gen).repeat_interleave(G, dim=0)
    completions = torch.randint(3, vocab, (PROMPTS * G, COMPLETION_TOKENS), generator=gen)
    rewards = torch.rand(PROMPTS * G, generator=gen)
    return torch.cat([prompts, completions], 1).to(device), A.leave_one_out_advantages(rewards, G).to(device)


def step_one_gradient(model_dir: Path, bf16: bool) -> tuple[dict[str, torch.Tensor], str, float]:
    cfg = RLOOConfig(model_name_or_path=str(model_dir), num_generations=G, per_device_train_batch_size=PROMPTS * G,
                     max_grad_norm=0.0, bf16=bf16)
    acc = build_accelerator(cfg)  # the engine's: the launch's profile (DeepSpeed on CPU over gloo), never swapped
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    fill_deepspeed_config(acc, cfg)
    model, optimizer = acc.prepare(model, optimizer)
    model.train()
    input_ids, advantages = fixed_batch(acc.unwrap_model(model).config.vocab_size, acc.device)
    token_logps, _ = completion_token_logps(model, input_ids, torch.ones_like(input_ids), PROMPT_TOKENS, 1.0)
    seq_logps = A.sequence_log_probs(token_logps, torch.ones_like(token_logps))
    loss, _ = A.clipped_sequence_loss(seq_logps, seq_logps.detach(), advantages, 0.2, 0.2)
    acc.backward(loss)
    if is_deepspeed(acc):
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p).float().cpu() for n, p in acc.unwrap_model(model).named_parameters()}
        variant = "zero3-bf16" if bf16 else "zero3"
    else:
        grads = {n: p.grad.float().cpu() for n, p in acc.unwrap_model(model).named_parameters() if p.grad is not None}
        variant = "bf16" if bf16 else "fp32"
    return grads, variant, loss.item()


def compare(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(cosine similarity, relative norm difference) of the whole flattened gradients."""
    names = sorted(reference)
    missing = set(names) - set(grads)
    assert not missing, f"no gradient for {sorted(missing)[:5]}"
    dot = sum(float((grads[n].double() * reference[n].double()).sum()) for n in names)
    norm = math.sqrt(sum(float(grads[n].double().pow(2).sum()) for n in names))
    ref_norm = math.sqrt(sum(float(reference[n].double().pow(2).sum()) for n in names))
    return dot / (norm * ref_norm), abs(norm / ref_norm - 1)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--bf16", action="store_true")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--save", type=Path, help="write the fp32 single-process reference gradient here")
    what.add_argument("--compare", type=Path, help="compare with the reference gradient written by --save")
    args = parser.parse_args()
    grads, variant, loss = step_one_gradient(args.model_dir, args.bf16)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    result = {"variant": variant, "loss": loss, "grad_norm": norm, "ok": norm > 0 and math.isfinite(norm)}
    if args.save:
        save_file({n: g.contiguous() for n, g in grads.items()}, args.save)
    else:
        min_cosine, max_norm_diff = TOLERANCES[variant]
        cosine, norm_diff = compare(grads, load_file(args.compare))
        result.update(cosine=cosine, norm_diff=norm_diff, min_cosine=min_cosine, max_norm_diff=max_norm_diff)
        result["ok"] = result["ok"] and cosine >= min_cosine and norm_diff <= max_norm_diff
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
