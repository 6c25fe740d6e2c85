"""Run under `accelerate launch`: TRL's Python API in every process (a model object, a callable reward, a Dataset,
an eval dataset, a callback), then each rank writes a digest of its parameters.

argv: output_dir model_dir prompts_file [resume]
"""

import hashlib
import json
import sys
from pathlib import Path

import datasets
from transformers import AutoModelForCausalLM, TrainerCallback

from rloo_engine import RLOOConfig, RLOOTrainer
from rloo_engine.distributed import end_process_group
from tests.engine.helpers import target_token_fraction

out, model_dir, prompts = sys.argv[1:4]
resume = len(sys.argv) > 4


class CountSteps(TrainerCallback):
    steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        CountSteps.steps += 1


data = datasets.load_dataset("json", data_files=prompts, split="train")
trainer = RLOOTrainer(
    model=AutoModelForCausalLM.from_pretrained(model_dir),
    reward_funcs=[target_token_fraction],
    args=RLOOConfig(output_dir=out, num_generations=2, per_device_train_batch_size=4, max_completion_length=4,
                    beta=0.05, learning_rate=1e-3, max_steps=4, save_steps=2, logging_steps=1, disable_tqdm=True,
                    seed=0, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4),
    train_dataset=data, eval_dataset=data.select(range(5)), callbacks=[CountSteps()],
)
trainer.train(resume_from_checkpoint=True if resume else None)
acc = trainer.acc
digest = hashlib.sha256()
for _, p in sorted(acc.unwrap_model(trainer.policy).named_parameters()):
    digest.update(p.detach().cpu().float().numpy().tobytes())
Path(out, f"digest-rank{acc.process_index}.json").write_text(json.dumps({
    "digest": digest.hexdigest(), "step": trainer.global_step, "num_processes": acc.num_processes,
    "callback_steps": CountSteps.steps, "log_history_steps": [h["step"] for h in trainer.state.log_history],
}))
del trainer, acc  # the DDP model holds the group: it must go before the group does
end_process_group()
