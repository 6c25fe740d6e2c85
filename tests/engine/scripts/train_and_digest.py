"""Run under `accelerate launch`: trains from flags, then each rank writes a digest of its parameters and its view of the ranks."""

import hashlib
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from rloo_engine.cli import parse_train_args
from rloo_engine.distributed import end_process_group
from rloo_engine.trainer import RLOOTrainer

trainer = RLOOTrainer(parse_train_args(sys.argv[1:]))
trainer.train()
acc = trainer.acc
digest = hashlib.sha256()
for _, p in sorted(acc.unwrap_model(trainer.policy).named_parameters()):
    if isinstance(p, DTensor):  # an FSDP2 shard: the whole parameter (collective, every rank in the same order)
        p = p.full_tensor()
    digest.update(p.detach().cpu().float().numpy().tobytes())
rank = acc.process_index


def held(model) -> int:
    """Elements of `model` this rank holds at the end: a shard's local part, a whole tensor's all."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


frozen = [m for m in [trainer.ref, *(getattr(s, "model", None) for s in trainer.reward_sources)] if m is not None]
out = Path(trainer.cfg.output_dir) / f"digest-rank{rank}.json"
out.write_text(json.dumps({
    "rank": rank, "num_processes": acc.num_processes, "is_main_process": acc.is_main_process,
    "distributed_type": acc.distributed_type.value,
    "dist_rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else None,
    "dist_world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
    "frozen_held": [held(m) for m in frozen], "frozen_total": [sum(p.numel() for p in m.parameters()) for m in frozen],
    "digest": digest.hexdigest(), "step": trainer.global_step, "prompts_seen": trainer.sampler.state_dict(),
}))
if isinstance(trainer.policy, torch.distributed.fsdp.FSDPModule):
    # accelerate keeps the tail group (final norm, head) unsharded after forward, for the backward that follows; a
    # generation in between must leave it so. A forward, then: is the head's weight whole (a plain tensor)?
    with torch.no_grad():
        trainer.policy(input_ids=torch.ones(1, 4, dtype=torch.long))
    head = acc.unwrap_model(trainer.policy).get_output_embeddings().weight
    out.write_text(json.dumps({**json.loads(out.read_text()), "head_whole_after_forward": not isinstance(head, DTensor)}))
del trainer, acc  # the DDP model holds the group: it must go before the group does, not at teardown
end_process_group()  # as `rloo-engine train` does: gloo can abort a process that exits with its group alive
