"""`run_evaluation`: completions, then pairings, then judging (through the cache), then statistics and the report.

Reads top to bottom like the stage diagram. Generation runs before the event loop starts; judging
runs in one event loop, where every judgment is written to the cache as it returns. A failure that
no judgment can survive (bad key or model, budget) raises; nothing partial is reported as a result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rloo_engine.evaluation.budget import Price, SpendTracker
from rloo_engine.evaluation.cache import JudgmentCache, cache_key
from rloo_engine.evaluation.config import PAIRINGS, EvalConfig
from rloo_engine.evaluation.data import EvalPrompt, load_completions, prompt_text, save_completions
from rloo_engine.evaluation.judges import build_judge
from rloo_engine.evaluation.judges.base import Judgment, SlotPair
from rloo_engine.evaluation.pairings import (
    Order,
    PairItem,
    build_items,
    choose_pairings,
    combine_orders,
    order_score,
    winner,
)
from rloo_engine.evaluation.preflight import (
    check_image_generation,
    check_judge,
    check_reference_answers,
    load_eval_prompts,
)
from rloo_engine.evaluation.report import EvalReport, Usage, write_report, write_table
from rloo_engine.evaluation.result_checks import (
    UntrustworthyResultError,
    check_something_to_judge,
    failure_problems,
    judge_warnings,
    report_warnings,
    served_models,
)
from rloo_engine.evaluation.scoring import JudgedItem, paired_difference, summarize_pairing
from rloo_engine.evaluation.templates import JudgeTemplate
from rloo_engine.progress import progress_bar

log = logging.getLogger(__name__)
T = TypeVar("T")
SlotKey = tuple[str, str, Order]  # (pairing, prompt_id, order)


def run_evaluation(
    cfg: EvalConfig,
    *,
    policy_path: str | Path | None = None,
    sft_path: str | Path | None = None,
    output_dir: str | Path | None = None,
) -> EvalReport:
    """Runs every configured pairing and returns the report (also written to `<output_dir>/results.json`).

    `policy_path` / `sft_path` generate completions from that model, overriding the config's model
    path or completions file for that side. `output_dir` overrides `cfg.output_dir`. Raises
    ConfigError (bad option or input), JudgeEndpointError (401/403/404, unreachable), BudgetExceededError, or
    EvaluationError / UntrustworthyResultError when the numbers would mislead (see checks.py).
    """
    started = time.perf_counter()
    cfg = _apply_overrides(cfg, policy_path, sft_path, output_dir)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    template = check_judge(cfg)  # a missing key or an unimportable rule fails now, not after generating

    # 1. prompts and completions of each side
    prompts, gold_answer_counts = with_reference_answers(cfg, load_eval_prompts(cfg))
    check_image_generation(cfg, prompts)  # both sides' refusals before either model loads
    completions, completion_paths = collect_completions(cfg, prompts, out_dir)
    generated = time.perf_counter()

    # 2. pairings: which prompts are compared in which orders
    names = choose_pairings(cfg.pairings, set(completions))
    texts = [(ep.prompt_id, prompt_text(ep.prompt)) for ep in prompts]
    gold = {ep.prompt_id: ep.reference_answer for ep in prompts if ep.reference_answer is not None}
    pictures = {ep.prompt_id: ep.images for ep in prompts if ep.images}
    items: dict[str, list[PairItem]] = {}
    missing: dict[str, int] = {}
    for name in names:
        side_a, side_b = PAIRINGS[name]
        items[name], missing[name] = build_items(
            name, completions[side_a], completions[side_b], texts, cfg.order_mode, cfg.seed,
            reference_answers=gold, images=pictures,
        )
        sources = f"{completion_paths.get(side_a, side_a)}, {completion_paths.get(side_b, side_b)}"
        check_something_to_judge(name, len(items[name]), missing[name], sources)

    # 3. judging, through the cache
    price = _price(cfg)
    spend = SpendTracker(price, cfg.budget_usd, cfg.judge.model or "")
    cache_path = cfg.resolved_cache_path()
    with JudgmentCache(cache_path) as cache:
        slots, results, identity, template_hash, run_info = _run(
            judge_items(cfg, template, spend, [i for name in names for i in items[name]], cache)
        )
    judged_at = time.perf_counter()

    # 4. statistics
    judged = {
        name: [_judged_item(item, slots, results, cfg.both_orders_rule) for item in items[name]] for name in names
    }
    pairing_results = {
        name: summarize_pairing(name, *PAIRINGS[name], judged[name], missing[name], cfg) for name in names
    }
    difference = None
    if "policy_vs_reference" in judged and "sft_vs_reference" in judged:
        difference = paired_difference(judged["policy_vs_reference"], judged["sft_vs_reference"], cfg)

    # 5. report
    results_path, judgments_path = out_dir / "results.json", out_dir / "judgments.jsonl"
    write_table(judgments_path, _table_rows(judged, slots, results, template_hash))
    n_identical = sum(r.n_identical for r in pairing_results.values())
    finished = time.perf_counter()
    report = EvalReport(
        pairings=pairing_results,
        paired_difference=difference,
        usage=_usage(results, price, cfg.budget_usd, n_identical),
        judge={
            "backend": cfg.judge.backend,
            "model": cfg.judge.model,
            "base_url": cfg.judge.base_url,
            "function": cfg.judge.function,
            "template": template.info() if template else None,
            "identity": identity,
            "order_mode": cfg.order_mode,
            "both_orders_rule": cfg.both_orders_rule if cfg.order_mode == "both" else None,
            "mode": cfg.judge.mode if cfg.judge.backend == "openai" else None,
            "verdict": cfg.judge.verdict if cfg.judge.backend == "openai" else None,
            "served_models": served_models(results.values()),
            **({"reference_answers": gold_answer_counts} if gold_answer_counts else {}),
            **({"batch": run_info} if run_info else {}),
        },
        warnings=report_warnings(pairing_results, cfg) + judge_warnings(results.values(), cfg.judge.model)
        + reference_answer_warnings(gold_answer_counts),
        timings={
            "generation_s": round(generated - started, 3),
            "judging_s": round(judged_at - generated, 3),
            "statistics_s": round(finished - judged_at, 3),
            "total_s": round(finished - started, 3),
        },
        completions=completion_paths,
        results_path=results_path,
        judgments_path=judgments_path,
        cache_path=cache_path,
        config=cfg.model_dump(mode="json"),
    )
    for warning in report.warnings:
        log.warning(warning)
    problems = failure_problems(pairing_results, cfg)
    if problems:
        raise UntrustworthyResultError(
            "; ".join(problems) + f". Nothing was reported as a result; every judgment is in {judgments_path}",
            report,
        )
    write_report(report)
    return report


def _apply_overrides(
    cfg: EvalConfig, policy_path: str | Path | None, sft_path: str | Path | None, output_dir: str | Path | None
) -> EvalConfig:
    update: dict[str, Any] = {}
    if policy_path is not None:
        update.update(policy_model_path=str(policy_path), policy_completions=None)
    if sft_path is not None:
        update.update(sft_model_path=str(sft_path), sft_completions=None)
    if output_dir is not None:
        update["output_dir"] = str(output_dir)
    return cfg.model_copy(update=update)


def with_reference_answers(
    cfg: EvalConfig, prompts: list[EvalPrompt]
) -> tuple[list[EvalPrompt], dict[str, Any] | None]:
    """The prompts a reference-guided template can judge (those with a gold answer), and their count for the
    report (None without `reference_answer_column`). The others are left out of every pairing, not shown to
    the judge with an empty reference."""
    if cfg.reference_answer_column is None:
        return prompts, None
    kept = [ep for ep in prompts if ep.reference_answer is not None]
    check_reference_answers(cfg, len(kept))
    counts = {"column": cfg.reference_answer_column, "prompts": len(kept), "prompts_without": len(prompts) - len(kept)}
    return kept, counts


def reference_answer_warnings(counts: dict[str, Any] | None) -> list[str]:
    if not counts or not counts["prompts_without"]:
        return []
    total = counts["prompts"] + counts["prompts_without"]
    return [
        f"{counts['prompts_without']} of {total} eval prompts have no reference answer in reference_answer_column "
        f"{counts['column']!r}; the reference-guided judge cannot judge them, so every pairing leaves them out"
    ]


def collect_completions(
    cfg: EvalConfig, prompts: list[EvalPrompt], out_dir: Path
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """({side: {prompt_id: completion}}, {side: JSONL path}) for each side that has a source."""
    sides: dict[str, dict[str, str]] = {}
    paths: dict[str, str] = {}
    completions_dir = out_dir / "completions"
    if cfg.reference_column:
        sides["reference"] = {ep.prompt_id: ep.reference for ep in prompts if ep.reference is not None}
        paths["reference"] = str(save_completions(completions_dir / "reference.jsonl", prompts, sides["reference"]))
    elif cfg.reference_completions:
        sides["reference"] = load_completions(cfg.reference_completions)
        paths["reference"] = cfg.reference_completions
    for side in ("policy", "sft"):
        model_path, file = getattr(cfg, f"{side}_model_path"), getattr(cfg, f"{side}_completions")
        if model_path:
            from rloo_engine.evaluation.generate import generate_or_reuse  # imports torch

            out_path = completions_dir / f"{side}.jsonl"
            sides[side] = generate_or_reuse(
                model_path, prompts, cfg.generation, out_path, field=f"{side}_model_path", progress=cfg.progress
            )
            paths[side] = str(out_path)
        elif file:
            sides[side] = load_completions(file)
            paths[side] = file
    return sides, paths


async def judge_items(
    cfg: EvalConfig, template: JudgeTemplate | None, spend: SpendTracker, items: list[PairItem], cache: JudgmentCache
) -> tuple[dict[SlotKey, str], dict[str, tuple[Judgment, bool]], dict[str, Any], str | None, dict[str, Any]]:
    """Judges every (item, order) not in the cache; returns (slot -> cache key, key -> (judgment, cached),
    judge identity, template hash, the judge's run info). Each new judgment is written to the cache as soon
    as it returns."""
    judge = build_judge(cfg.judge, template, spend, batch_store=cache)
    try:
        identity = judge.identity()
        slots: dict[SlotKey, str] = {}
        requests: dict[str, SlotPair] = {}
        for item in items:
            for order in item.orders:
                pair = item.slot_pair(order)
                key = cache_key(identity, pair)
                slots[(item.pairing, item.prompt_id, order)] = key
                requests.setdefault(key, pair)
        results = {key: (j, True) for key, j in cache.get_many(requests).items()}
        for key, (judgment, _) in results.items():
            if judge.reparse(judgment):  # a parse_error stored by an older parser, parsed again from its replies
                cache.put(key, identity, judge.template_hash, requests[key], judgment)
        todo = [key for key in requests if key not in results]
        if results:
            log.info("judge cache %s: %d of %d judgments already done", cache.path, len(results), len(requests))
        bar = progress_bar(total=len(requests), initial=len(results), desc="judging", unit="judgment", disable=not cfg.progress)

        def record(index: int, judgment: Judgment) -> None:
            key = todo[index]
            cache.put(key, identity, judge.template_hash, requests[key], judgment)
            results[key] = (judgment, False)
            bar.update(1)

        try:
            await judge.judge([requests[key] for key in todo], record)
        finally:
            bar.close()
    finally:
        await judge.aclose()
    return slots, results, identity, judge.template_hash, judge.run_info()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Runs `coro` to completion, in a worker thread when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _judged_item(
    item: PairItem, slots: dict[SlotKey, str], results: dict[str, tuple[Judgment, bool]], rule: str
) -> JudgedItem:
    judgments = {order: results[slots[(item.pairing, item.prompt_id, order)]][0] for order in item.orders}
    return JudgedItem(item, judgments, combine_orders(item, judgments, rule))


def _price(cfg: EvalConfig) -> Price | None:
    if cfg.judge.backend != "openai" or cfg.judge.model not in cfg.prices:
        return None
    p = cfg.prices[cfg.judge.model]
    return Price(p.input_per_million, p.output_per_million, p.batch_input_per_million, p.batch_output_per_million)


def _usage(
    results: dict[str, tuple[Judgment, bool]], price: Price | None, budget: float | None, n_identical: int
) -> Usage:
    fresh = [j for j, cached in results.values() if not cached]
    every = [j for j, _ in results.values()]
    pt, ct = sum(j.prompt_tokens for j in fresh), sum(j.completion_tokens for j in fresh)
    total_pt, total_ct = sum(j.prompt_tokens for j in every), sum(j.completion_tokens for j in every)

    def cost(judgments: list[Judgment]) -> float | None:
        """Live tokens at live prices, Batch API tokens at batch prices."""
        if price is None:
            return None
        bpt, bct = sum(j.batch_prompt_tokens for j in judgments), sum(j.batch_completion_tokens for j in judgments)
        pt_all, ct_all = sum(j.prompt_tokens for j in judgments), sum(j.completion_tokens for j in judgments)
        live = price.cost(pt_all - bpt, ct_all - bct)
        return live + price.cost(bpt, bct, batch=True)

    return Usage(
        requests=sum(j.requests for j in fresh),
        judgments_made=len(fresh),
        judgments_cached=len(every) - len(fresh),
        judgments_without_call=n_identical,
        prompt_tokens=pt,
        completion_tokens=ct,
        cost_usd=cost(fresh),
        batch_prompt_tokens=sum(j.batch_prompt_tokens for j in fresh),
        batch_completion_tokens=sum(j.batch_completion_tokens for j in fresh),
        total_prompt_tokens=total_pt,
        total_completion_tokens=total_ct,
        total_cost_usd=cost(every),
        budget_usd=budget,
    )


def _table_rows(
    judged: dict[str, list[JudgedItem]],
    slots: dict[SlotKey, str],
    results: dict[str, tuple[Judgment, bool]],
    template_hash: str | None,
) -> list[dict[str, Any]]:
    rows = []
    for name, judged_items in judged.items():
        model_a, model_b = PAIRINGS[name]
        names = {"a": model_a, "b": model_b, "tie": "tie"}
        for ji in judged_items:
            item = ji.item
            base = {
                "pairing": name,
                "prompt_id": item.prompt_id,
                "prompt": item.prompt,
                "model_a": model_a,
                "model_b": model_b,
                "completion_a": item.completion_a,
                "completion_b": item.completion_b,
                "template_hash": template_hash,
            }
            if not item.orders:
                rows.append(
                    {
                        **base,
                        "order": None,
                        "status": "ok",
                        "parsed_verdict": "tie",
                        "winner": "tie",
                        "prompt_tokens": 0,
                        "completion_tokens": 0,
                        "cached": False,
                    }
                )
            for order in item.orders:
                key = slots[(name, item.prompt_id, order)]
                j, cached = results[key]
                w = winner(order, j.verdict) if j.status == "ok" else None
                rows.append(
                    {
                        **base,
                        "order": order,
                        "status": j.status,
                        "raw_verdict": j.raw_texts[0] if j.raw_texts else None,
                        "raw_verdict_reask": j.raw_texts[1] if len(j.raw_texts) > 1 else None,
                        "parsed_verdict": j.verdict,
                        "soft_preference": order_score(order, j) if j.slot_a_probability is not None else None,
                        "winner": names[w] if w else None,
                        "prompt_tokens": j.prompt_tokens,
                        "completion_tokens": j.completion_tokens,
                        "cached": cached,
                        "served_model": j.served_model,
                        "error": j.error,
                        "cache_key": key,
                    }
                )
    return rows
