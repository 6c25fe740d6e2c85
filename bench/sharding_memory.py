"""Memory per process under DDP, DeepSpeed ZeRO-3 and FSDP2: the same model and run, 2 CPU processes (gloo).

    python bench/sharding_memory.py                          # hidden 512, 8 layers, vocabulary 32k: ~3 min
    python bench/sharding_memory.py --hidden 1024 --layers 8 --output r.json

Each profile runs `rloo-engine`'s trainer for `--steps` steps (policy, a frozen reference, a same-shape reward model)
under `accelerate launch --num_processes 2` with the shipped profile (plain `--multi_gpu` for DDP). Each rank reports:
- the bytes it holds of the policy's parameters, the optimizer's master copies and states, and of the reference's
  and reward model's parameters, counted from the tensors themselves (a shard counts its local part), at the end;
- its peak RSS (`ru_maxrss`) and its RSS at the end. The peak includes loading: under DDP and ZeRO-3 every rank
  loads each model whole; under FSDP2 (`fsdp_cpu_ram_efficient_loading`) only rank 0 does, the others being sent
  their shards. So on CPU the peak is not where sharding pays; the held bytes and the end RSS are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROFILES = ("ddp", "deepspeed_zero3", "fsdp2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000, help="the model's vocabulary (the tokenizer's is 512)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--profiles", nargs="+", choices=PROFILES, default=list(PROFILES))
    p.add_argument("--output", help="write the results as JSON here")
    return p.parse_args(argv)


def tensor_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def held_bytes(trainer) -> dict[str, int]:
    """This rank's bytes of each model's parameters (a ZeRO-3 parameter's partition is its `ds_tensor`), of the
    optimizer's states, and of master copies the optimizer steps instead of the model's own parameters (DeepSpeed's
    flat float32 partitions). Gradients are not counted: they exist only inside the update (the peak RSS has them)."""
    import torch

    def params(model) -> int:
        return sum(tensor_bytes(p.ds_tensor if hasattr(p, "ds_tensor") else p) for p in model.parameters())

    optimizer = trainer.optimizer
    while getattr(optimizer, "optimizer", None) is not None:  # accelerate's wrapper, DeepSpeed's ZeRO optimizer
        optimizer = optimizer.optimizer
    states = sum(tensor_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    own = {id(p) for p in trainer.policy.parameters()}
    masters = sum(tensor_bytes(p) for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    reward = [s.model for s in trainer.reward_sources if hasattr(s, "model")]
    return {"policy_params": params(trainer.policy), "master_copies": masters, "optimizer_states": states,
            "reference_params": params(trainer.ref) if trainer.ref is not None else 0,
            "reward_params": sum(params(m) for m in reward)}


def rank_main(report: str, train_args: list[str]) -> None:
    import resource

    from rloo_engine.cli import parse_train_args
    from rloo_engine.distributed import end_process_group
    from rloo_engine.trainer import RLOOTrainer

    trainer = RLOOTrainer(parse_train_args(train_args))
    trainer.train()
    held = held_bytes(trainer)
    rss_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    row = {"rank": trainer.acc.process_index, "distributed_type": trainer.acc.distributed_type.value, **held,
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "end_rss_mib": rss_kib / 1024}
    Path(f"{report}.{row['rank']}").write_text(json.dumps(row))
    del trainer
    end_process_group()


def build_assets(root: Path, args: argparse.Namespace) -> tuple[Path, Path, Path]:
    from rloo_engine.testing import tiny_models

    tok = tiny_models.train_tokenizer(vocab_size=512)
    shape = dict(hidden=args.hidden, layers=args.layers, intermediate_size=4 * args.hidden, num_attention_heads=8,
                 num_key_value_heads=4, tie_word_embeddings=False)
    policy = tiny_models.build_causal_lm(root / "policy", tok, vocab_size=args.vocab, **shape)
    reward = tiny_models.build_reward_model(root / "reward", tok, hidden=args.hidden, layers=args.layers)
    prompts = tiny_models.write_prompt_file(root / "prompts.jsonl", num_prompts=64)
    return policy, reward, prompts


def run_profile(profile: str, assets: tuple[Path, Path, Path], root: Path, steps: int) -> list[dict]:
    policy, reward, prompts = assets
    launcher = (["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
                if profile == "ddp" else ["--config_file", str(REPO / "deployments" / "accelerate" / f"{profile}.yaml")])
    report = root / f"report-{profile}"
    train = ["--model_name_or_path", str(policy), "--reward_model_name_or_path", str(reward), "--dataset_name",
             str(prompts), "--output_dir", str(root / f"out-{profile}"), "--num_generations", "4",
             "--per_device_train_batch_size", "8", "--max_completion_length", "16", "--beta", "0.05",
             "--max_steps", str(steps), "--save_steps", "0", "--logging_steps", "1", "--disable_tqdm",
             "--report_to", "none"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--num_processes", "2", "--main_process_port",
           "0", str(Path(__file__).resolve()), "--rank-report", str(report), *train]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{profile}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{report}.{r}").read_text()) for r in (0, 1)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--rank-report" in argv:
        i = argv.index("--rank-report")
        rank_main(argv[i + 1], argv[:i] + argv[i + 2:])
        return 0
    args = parse_args(argv)
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = build_assets(root, args)
        results = {p: run_profile(p, assets, root, args.steps) for p in args.profiles}
    print(f"hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; 2 processes; MiB per process "
          "(rank 0 / rank 1)")
    keys = ("policy_params", "master_copies", "optimizer_states", "reference_params", "reward_params")
    print(f"{'profile':16s} " + " ".join(f"{k:>18s}" for k in (*keys, "end_rss", "peak_rss")))
    for profile, ranks in results.items():
        cells = [" / ".join(f"{r[k] / mib:.0f}" for r in ranks) for k in keys]
        cells += [" / ".join(f"{r[k]:.0f}" for r in ranks) for k in ("end_rss_mib", "peak_rss_mib")]
        print(f"{profile:16s} " + " ".join(f"{c:>18s}" for c in cells))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
