"""The trainer's bookkeeping around its loop (`trainer.py`): logging rows, evaluating, checkpoints and resuming,
the callbacks' requests, the sampler-mismatch records (and importance weights), and TRL's `save_model`. A mixin of
RLOOTrainer, so `train()` there reads whole."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

from rloo_engine import algorithm as A
from rloo_engine.batch import GenerationBatch
from rloo_engine.distributed import outside_zero_init, unwrapped
from rloo_engine.logprobs import batched_token_logps
from rloo_engine.metrics import reduce_window, window_values
from rloo_engine.models import load_policy, reference_context
from rloo_engine.reward_sources import compute_rewards
from rloo_engine.run import checkpoint as ckpt
from rloo_engine.run.continuity import config_snapshot


class TrainerBookkeeping:
    """Methods of RLOOTrainer that keep its records; they read the trainer's attributes (set in its __init__)."""

    @property
    def processing_class(self):
        """TRL's name: what is saved beside the model, a vision-language model's processor (its tokenizer, image
        processor and chat template) or the tokenizer."""
        return self.processor or self.tokenizer

    @property
    def unwrapped_policy(self):
        """The policy without accelerate's DDP or DeepSpeed wrapper (`distributed.unwrapped`)."""
        return unwrapped(self.acc, self.policy)

    def save_model(self, output_dir: str | None = None) -> Path:
        """TRL's `save_model`: the policy (a LoRA run: its adapter) and tokenizer in HF format, into `output_dir`
        (default: the config's); every process must call it."""
        out = Path(output_dir or self.cfg.output_dir)
        ckpt.save_model_files(self.acc, self.policy, self.processing_class, out)
        return out

    def _callback_flags(self, control) -> dict[str, bool]:
        """The callbacks' requests for this step, set on every process if on any (each one's work is collective)."""
        names = ("should_training_stop", "should_save", "should_evaluate", "should_log")
        flags = [bool(getattr(control, n)) for n in names] if self.callbacks.callbacks else [False] * len(names)
        if self.callbacks.callbacks and self.acc.num_processes > 1:
            flags = [bool(v) for v in self.acc.gather(torch.tensor([flags], device=self.acc.device)).amax(0).tolist()]
        return dict(zip(names, flags))

    # ------------------------------------------------------------------ logging, saving, resuming
    def _log(self, train: bool = True, evaluated: dict[str, float] | None = None) -> dict[str, float]:
        """One row at this step (rank 0 writes): with `train`, the means over the window since the last log,
        averaged over processes; and an evaluation's metrics. `log_history` and `on_log` get them as the HF
        Trainer gives them, a training row and an eval row; the sinks one row, so a resume skips neither."""
        rows = []
        if train:
            names, local = window_values(self.window)
            everyone = self.acc.gather(torch.tensor([local], device=self.acc.device, dtype=torch.float64))
            rows.append({**reduce_window(names, everyone.tolist()), "epoch": self._epoch()})  # (procs, K) -> K
        if evaluated:
            rows.append({**evaluated, "epoch": self._epoch()})
        self.logger.log(self.global_step, {k: v for row in rows for k, v in row.items()})
        for row in rows:
            self.reward_context.logged(self.global_step, row)
            self.callbacks.event("on_log", self.cfg, self.state, logs=row)
        if evaluated:
            self.callbacks.event("on_evaluate", self.cfg, self.state, metrics=evaluated)
        if train and self.cfg.log_completions and self.acc.is_main_process:
            self.logger.log_completions(self.global_step, self.last_samples,
                                        self.cfg.num_completions_to_print or self.cfg.num_generations,
                                        self._sample_images())
        if train:
            self.window.clear()
        return {k: v for row in rows for k, v in row.items()}

    def _sample_images(self) -> list[list] | None:
        """Each logged sample's prompt images (G samples share a prompt's), with `log_multimodal`; else None."""
        draw = self.feed.last_taken
        if not self.cfg.log_multimodal or draw is None or draw.images is None:
            return None
        return [draw.images[i // self.cfg.num_generations] for i in range(len(self.last_samples))]

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        """Every eval dataset with this step's weights, the policy in eval mode (`eval_during_training.py`)."""
        c = self.cfg

        def generate(rendered: list[str], g: int, add_special_tokens: bool):
            self._generation_weights()
            return self.backend.generate(rendered, g, add_special_tokens=add_special_tokens)

        def score(prompts, completions, completion_ids, columns):
            result = compute_rewards(self.reward_sources, c.reward_weights, c.reward_clip_range, prompts, completions,
                                     completion_ids, columns, self.reward_context.kwargs(self.global_step,
                                                                                          self._epoch()))
            self.reward_context.merge(len(completions))  # what reward functions log while evaluating is dropped
            return result

        def sequence_kl(rollout) -> torch.Tensor:
            ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1).to(self.acc.device)
            attention = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1).to(self.acc.device)
            mask, P, n = rollout.completion_mask.to(self.acc.device), rollout.prompt_ids.size(1), c.per_device_eval_batch_size
            with self.acc.autocast():  # the training forwards' fast paths: a group's prompt runs once
                logps = batched_token_logps(self.policy, ids, attention, P, c.temperature, n, self.chunked_logprobs,
                                            self.share_prompts)
                with reference_context(self.unwrapped_policy, self.ref):
                    ref_logps = batched_token_logps(self.ref or self.policy, ids, attention, P, c.temperature, n,
                                                    self.chunked_logprobs, self.share_prompts)
            return A.sequence_kl(logps, ref_logps, mask)

        self.policy.eval()
        try:
            return self.evaluation.run(self.global_step, generate, score, sequence_kl if c.beta > 0 else None)
        finally:
            self.policy.train()

    def _generator_weights(self, old, generator_logps, mask) -> torch.Tensor | None:
        """Logs how far the generator's (vLLM's) log-probs are from pi_old, the trainer's; with
        `vllm_importance_sampling_correction`, returns (and logs) the importance weights pi_old / pi_vllm."""
        c = self.cfg
        sampler = "vllm" if c.use_vllm else "bf16_decoding"  # generation_dtype: bfloat16 on the HF backend
        for k, v in A.logprob_difference_stats(old, generator_logps, mask).items():
            self.window[f"{sampler}/logprob_diff_{k}"].append(v.item())
        if not c.vllm_importance_sampling_correction:
            return None
        weights = A.generator_importance_weights(old, generator_logps, mask, c.vllm_importance_sampling_mode,
                                                 c.vllm_importance_sampling_clip_min,
                                                 c.vllm_importance_sampling_clip_max)
        for k, v in A.importance_weight_stats(weights, mask).items():
            self.window[f"sampling/importance_sampling_ratio/{k}"].append(v.item())
        return weights

    def _epoch(self) -> float:  # passes over the prompt dataset so far, fractional, as logged (a stream: whole)
        position = self.sampler.state_dict()["position"] if self.dataset_size else 0
        return self.sampler.epoch + position / (self.dataset_size or 1)

    def _trainer_state(self) -> dict:
        # A batch still in flight is not saved: a resumed run draws its prompts again.
        return {"global_step": self.global_step, "sampler": self.feed.state_dict(), "cursor": self.cursor,
                "total_steps": self.total_steps, "num_processes": self.acc.num_processes,
                "log_history": self.state.log_history,  # TrainerState's, as the HF Trainer's checkpoints keep it
                "config": config_snapshot(self.cfg, self.inputs.describe())}  # a resume checks the same trajectory

    def _fresh_policy(self) -> torch.nn.Module:
        """A whole copy of the initial policy (LoRA-wrapped like it), loaded outside ZeRO-3's partitioning."""
        with outside_zero_init(self.acc):
            return load_policy(self.cfg)

    def _save(self) -> None:
        rank_state = {"batch": self.batch.state_dict() if self.batch is not None else None, "cursor": self.cursor,
                      "window": dict(self.window)}
        ckpt.save_checkpoint(self.acc, self.policy, self.processing_class, self.cfg.output_dir, self.global_step,
                             self._trainer_state(), rank_state, self.cfg.save_total_limit)

    def _maybe_resume(self) -> int:
        """Loads `self.resume_path` (validated at start-up); either way the history files end at the start step."""
        path = self.resume_path
        if path is None:
            self.logger.truncate_after(-1)  # a run killed before its first checkpoint must not leave steps behind
            return 0
        state, rank_state = ckpt.load_checkpoint(self.acc, path)
        self.global_step = self.state.global_step = state["global_step"]
        self.state.log_history = [row for row in state.get("log_history", []) if row["step"] <= self.global_step]
        self.sampler.load_state_dict(state["sampler"])
        self.cursor = rank_state["cursor"]
        if rank_state["batch"] is not None:
            self.batch = GenerationBatch.from_state_dict(rank_state["batch"], self.acc.device)
        self.window = defaultdict(list, rank_state["window"])
        self.logger.truncate_after(self.global_step)
        if self.acc.is_main_process:
            print(f"rloo-engine: resumed from {path} at step {self.global_step}", file=sys.stderr)
        return self.global_step
