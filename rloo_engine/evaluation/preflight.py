"""Checks of an evaluation's inputs that take seconds, run before anything expensive (generation, judging, or,
in the pipeline, RLOO training): the judge, the prompt set, the references and completions files."""

from __future__ import annotations

import importlib.util

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.config import EvalConfig
from rloo_engine.evaluation.data import EvalPrompt, load_completions, load_prompts
from rloo_engine.evaluation.judges import read_api_key
from rloo_engine.evaluation.templates import JudgeTemplate, load_template
from rloo_engine.import_paths import load_callable


def check_judge(cfg: EvalConfig) -> JudgeTemplate | None:
    """Loads the judge template, checks it fits the verdict mode and the reference answers, and checks the API key
    is set / the rule imports; ConfigError otherwise."""
    template = load_template(cfg.judge.template) if cfg.judge.backend in ("openai", "hf") else None
    check_template_fits(cfg, template)
    if cfg.judge.backend == "openai":
        read_api_key(cfg.judge)
        # Imported here so that their import time (aiohttp; openai for the Batch API, ~1 s) is not in judging_s.
        import rloo_engine.evaluation.judges.openai_judge  # noqa: F401

        if cfg.judge.mode == "batch":
            import rloo_engine.evaluation.judges.openai_batch  # noqa: F401
    if cfg.judge.backend == "python":
        load_callable(cfg.judge.function or "", "judge.function")
    return template


def check_template_fits(cfg: EvalConfig, template: JudgeTemplate | None) -> None:
    """A logprobs verdict needs a one-letter template and a text verdict (openai) a verdict-line one; a template
    showing `{reference}` needs `reference_answer_column`, and that column needs such a template."""
    verdict = cfg.judge.verdict
    if template is not None and cfg.judge.backend == "openai":
        wanted = "letter" if verdict == "logprobs" else "verdict_line"
        if template.reply_format != wanted:
            raise ConfigError(
                f"judge.template: {cfg.judge.template!r} has reply_format {template.reply_format!r}, and "
                f"judge.verdict: {verdict!r} reads a reply in the format {wanted!r}: "
                + ("use tldr_letter, helpfulness_letter or a template with reply_format: letter"
                   if verdict == "logprobs" else "use judge.verdict: logprobs with it, or a verdict-line template")
            )
    needs_reference = template is not None and template.needs_reference
    if needs_reference and cfg.reference_answer_column is None:
        raise ConfigError(
            f"judge.template: {cfg.judge.template!r} shows each prompt's reference answer ({{reference}}), and "
            "reference_answer_column is not set; name the prompt-set column holding the gold answers"
        )
    if cfg.reference_answer_column is not None and not needs_reference:
        shown = f"judge.template {cfg.judge.template!r} has no {{reference}}" if template is not None else (
            f"the {cfg.judge.backend} judge uses no template")
        raise ConfigError(
            f"reference_answer_column: {cfg.reference_answer_column!r} is set, and {shown}, so the answers would never "
            "reach the judge; use a reference-guided template (math_reference) or unset reference_answer_column"
        )


def check_image_generation(cfg: EvalConfig, prompts: list[EvalPrompt]) -> None:
    """Eval prompts with images, for a side generated with vLLM or from a text-only model: refused before any model
    loads (a model path that does not load yet, e.g. the policy before training, is checked when it generates)."""
    if not any(ep.images for ep in prompts):
        return
    from rloo_engine.evaluation.generate import check_images_fit  # reads model configs with transformers

    for side in ("policy", "sft"):
        model_path = getattr(cfg, f"{side}_model_path")
        if model_path:
            check_images_fit(model_path, prompts, cfg.generation, field=f"{side}_model_path")


def load_eval_prompts(cfg: EvalConfig) -> list:
    """The prompt set `cfg` names (file or dataset, split, columns, cap), as `EvalPrompt`s."""
    return load_prompts(cfg.prompts, split=cfg.split, prompt_column=cfg.prompt_column,
                        reference_column=cfg.reference_column, reference_answer_column=cfg.reference_answer_column,
                        max_prompts=cfg.max_prompts)


def check_inputs(cfg: EvalConfig) -> dict[str, int]:
    """What an evaluation needs besides the models, checked before anything expensive runs (the pipeline calls
    it before training): the judge (template, key, rule), the prompt set, the references and any completions
    files (format, duplicates, ids matching the prompts), and that prompts with images can generate. Returns
    {side or "prompts": count}; raises ConfigError."""
    check_judge(cfg)
    prompts = load_eval_prompts(cfg)
    check_image_generation(cfg, prompts)  # before the vLLM install check: vLLM with images is refused anyway
    if cfg.generation.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        from rloo_engine.evaluation.generate_vllm import import_vllm

        import_vllm()  # raises the ConfigError that says what to install
    ids = {ep.prompt_id for ep in prompts}
    counts = {"prompts": len(prompts)}
    if cfg.reference_column:
        counts["reference"] = sum(ep.reference is not None for ep in prompts)
        if counts["reference"] == 0:
            raise ConfigError(f"reference_column: {cfg.reference_column!r} is empty in every row of {cfg.prompts}")
    if cfg.reference_answer_column:
        counts["reference_answer"] = sum(ep.reference_answer is not None for ep in prompts)
        check_reference_answers(cfg, counts["reference_answer"])
    files = {"reference": cfg.reference_completions, "policy": cfg.policy_completions, "sft": cfg.sft_completions}
    for side, path in files.items():
        if path:
            matching = len(ids & set(load_completions(path)))
            if matching == 0:
                raise ConfigError(
                    f"{side}_completions: no prompt of {path} is in the prompt set {cfg.prompts} (ids are hashes "
                    "of the prompt text); expected completions of these prompts"
                )
            counts[side] = matching
    return counts


def check_reference_answers(cfg: EvalConfig, n_with: int) -> None:
    """A reference-guided evaluation needs at least one prompt with a gold answer; ConfigError otherwise."""
    if cfg.reference_answer_column and n_with == 0:
        raise ConfigError(
            f"reference_answer_column: {cfg.reference_answer_column!r} is empty in every row of {cfg.prompts}; "
            "expected each prompt's gold answer as text"
        )
