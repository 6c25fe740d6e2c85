"""Runs in the TRL venv (.venv-trl): TRL's own `trl rloo` parser on a command line, printed as JSON.

stdin: a list of {"argv": [...], "steps_for": {"model": dir, "prompts": file} or null}, one per command line
(one TRL import for all). stdout: {"answers": [{"fields": {name: value}, "max_steps": n or null}, ...],
"defaults": {name: TRL's declared default}}, `max_steps` being what TRL's RLOOTrainer computes for the run (a real trainer on a tiny
model, so the number comes from TRL's sampler and transformers' Trainer, not from a formula copied here).
"""

import dataclasses
import enum
import json
import sys


def plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def trl_max_steps(training_args, model_args, model_dir: str, prompts: str) -> int:
    from datasets import load_dataset
    from trl import RLOOTrainer

    def constant_reward(completions, **kwargs):
        return [0.0] * len(completions)

    training_args.model_init_kwargs = {"dtype": model_args.dtype}
    trainer = RLOOTrainer(model=model_dir, reward_funcs=[constant_reward], args=training_args,
                          train_dataset=load_dataset("json", data_files=prompts, split="train"))
    return trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]


def main() -> None:
    from trl.scripts.rloo import make_parser

    answers = []
    for request in json.load(sys.stdin):
        parsed = make_parser().parse_args_and_config(request["argv"], fail_with_unknown_args=False)
        fields = {f.name: plain(getattr(obj, f.name)) for obj in parsed for f in dataclasses.fields(obj)}
        steps = None
        if request.get("steps_for"):
            steps = trl_max_steps(parsed[1], parsed[2], request["steps_for"]["model"], request["steps_for"]["prompts"])
        answers.append({"fields": fields, "max_steps": steps})
    json.dump({"answers": answers, "defaults": declared_defaults()}, sys.stdout)


def declared_defaults() -> dict:
    """Each field's default as its dataclass declares it (before `__post_init__` resolves any)."""
    from trl import DatasetMixtureConfig, ModelConfig, RLOOConfig
    from trl.scripts.rloo import RLOOScriptArguments

    out = {}
    for cls in (RLOOScriptArguments, RLOOConfig, ModelConfig, DatasetMixtureConfig):
        for f in dataclasses.fields(cls):
            factory = f.default_factory
            out[f.name] = plain(factory() if factory is not dataclasses.MISSING else f.default)
    return out


if __name__ == "__main__":
    main()
