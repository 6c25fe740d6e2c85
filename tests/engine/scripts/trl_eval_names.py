"""Runs in the TRL venv (.venv-trl): TRL's RLOOTrainer evaluating during training on a local tiny model, printed
as JSON: the keys of its eval log rows. argv: model_dir prompts_file output_dir."""

import json
import sys

from datasets import load_dataset
from trl import RLOOConfig, RLOOTrainer


def target_token_fraction(completion_ids, **kwargs):
    return [sum(10 <= t < 42 for t in ids) / max(len(ids), 1) for ids in completion_ids]


model_dir, prompts, out = sys.argv[1:4]
data = load_dataset("json", data_files=prompts, split="train")
args = RLOOConfig(output_dir=out, num_generations=4, per_device_train_batch_size=8, max_completion_length=4,
                  max_steps=1, logging_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4,
                  num_generations_eval=2, beta=0.05, report_to="none", bf16=False, use_cpu=True, save_strategy="no",
                  gradient_checkpointing=False)
trainer = RLOOTrainer(model=model_dir, reward_funcs=target_token_fraction, args=args, train_dataset=data,
                      eval_dataset=data.select(range(4)))
trainer.train()
rows = [row for row in trainer.state.log_history if any(k.startswith("eval_") for k in row)]
print(json.dumps(sorted({k for row in rows for k in row if k.startswith("eval_")})))
