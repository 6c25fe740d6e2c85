"""TRL's Python API with colocated vLLM: a model OBJECT whose weights differ from the files it was loaded from
(every weight scaled), an eval dataset. argv: model_dir prompts_file output_dir. Prints the metrics rows."""

import json
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoModelForCausalLM

from rloo_engine import RLOOConfig, RLOOTrainer
from tests.engine.helpers import target_token_fraction

model_dir, prompts, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_dir)
with torch.no_grad():
    for p in model.parameters():
        p.mul_(1.5)  # vLLM loads model_dir: unless the trainer syncs this object first, it samples other weights
data = datasets.load_dataset("json", data_files=prompts, split="train")
trainer = RLOOTrainer(
    model=model, reward_funcs=target_token_fraction, train_dataset=data, eval_dataset=data.select(range(4)),
    args=RLOOConfig(output_dir=out, num_generations=4, per_device_train_batch_size=8, max_completion_length=16,
                    max_steps=2, logging_steps=1, save_steps=0, disable_tqdm=True, use_vllm=True,
                    eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8, num_generations_eval=2),
)
trainer.train()
print(json.dumps([json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]))
