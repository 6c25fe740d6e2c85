"""Run under `accelerate launch`: trains from a YAML config, then each rank writes a digest of its parameters."""

import hashlib
import json
import sys
from pathlib import Path

from rloo_engine.cli import parse_train_args
from rloo_engine.trainer import RLOOTrainer

trainer = RLOOTrainer(parse_train_args(sys.argv[1:]))
trainer.train()
digest = hashlib.sha256()
for _, p in sorted(trainer.acc.unwrap_model(trainer.policy).named_parameters()):
    digest.update(p.detach().cpu().float().numpy().tobytes())
rank = trainer.acc.process_index
out = Path(trainer.cfg.output_dir) / f"digest-rank{rank}.json"
out.write_text(json.dumps({"rank": rank, "digest": digest.hexdigest(), "step": trainer.global_step,
                           "prompts_seen": trainer.sampler.state_dict()}))
