"""EvalConfig: the typed, validated options of a win-rate evaluation (`rloo-engine evaluate --config`).

Every field is documented where it is declared. Validation happens here, at the boundary: a bad
option fails with `ConfigError` naming the field before any model is loaded or any call is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator, model_validator

from rloo_engine.config_base import F, StrictModel, load_yaml, validated

PairingName = Literal["policy_vs_reference", "sft_vs_reference", "policy_vs_sft"]
PAIRINGS: dict[str, tuple[str, str]] = {
    "policy_vs_reference": ("policy", "reference"),
    "sft_vs_reference": ("sft", "reference"),
    "policy_vs_sft": ("policy", "sft"),
}


class EvalGenerationConfig(StrictModel):
    """How completions are generated for a model given by path (policy or SFT)."""

    backend: Literal["hf", "vllm"] = F(
        "hf",
        "`hf`: transformers `generate`, batched. `vllm`: an offline `vllm.LLM` in this process (the `vllm` extra), "
        "same prompts, chat template, truncation, EOS ids and greedy default; its fp32 greedy completions equal "
        "`hf`'s on the tiny test model. vLLM picks its own device (CUDA when present), so `device` must be `auto`.",
    )
    max_new_tokens: int = F(
        128, "Maximum tokens generated per completion. 128 fits TL;DR summaries; raise for dialogue.", ge=1
    )
    do_sample: bool = F(
        False,
        "Sample instead of greedy decoding. Greedy (the default) makes completions, and so the cache, reproducible.",
    )
    temperature: float = F(1.0, "Sampling temperature (only with do_sample).", gt=0.0)
    top_p: float = F(1.0, "Nucleus sampling mass (only with do_sample); 1.0 = off.", gt=0.0, le=1.0)
    batch_size: int = F(
        16, "Prompts per `generate` call. Prompts are sorted by length first, so padding stays small.", ge=1
    )
    max_prompt_length: int | None = F(
        512,
        "Prompts longer than this many tokens are truncated from the left (the end is what the model continues).",
        ge=1,
    )
    chat_template: bool = F(
        False,
        "Wrap plain-string prompts as a user message and render them with the tokenizer's chat template. "
        "Prompts given as message lists always use the chat template.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = F("float32", "Dtype the model is loaded in.")
    device: str = F("auto", "Torch device: `auto` (CUDA when available, else CPU), `cpu`, `cuda`, `cuda:1`, ...")
    seed: int = F(0, "Seed set before generation (matters only with do_sample).")
    generation_kwargs: dict[str, Any] = F(
        {},
        "Extra keyword arguments (override the above): for `model.generate` (backend hf), for `vllm.SamplingParams` "
        "(backend vllm).",
    )
    vllm_engine_kwargs: dict[str, Any] = F(
        {},
        "backend vllm: extra keyword arguments for `vllm.LLM`, e.g. gpu_memory_utilization, tensor_parallel_size, "
        "max_model_len (default: max_prompt_length + max_new_tokens, within the model's positions).",
    )

    @model_validator(mode="after")
    def _check_backend(self) -> EvalGenerationConfig:
        if self.backend == "vllm" and self.device != "auto":
            raise ValueError(
                f"device: {self.device!r} with backend: 'vllm'; vLLM places the model itself (CUDA_VISIBLE_DEVICES "
                "chooses the GPU), so leave device: auto"
            )
        if self.backend == "hf" and self.vllm_engine_kwargs:
            raise ValueError("vllm_engine_kwargs: set with backend: 'hf'; they are for backend: 'vllm'")
        return self


class TokenPrice(StrictModel):
    """Price of one judge model, in US dollars per million tokens."""

    input_per_million: float = F(..., "USD per 1M prompt (input) tokens.", ge=0.0)
    output_per_million: float = F(..., "USD per 1M completion (output) tokens.", ge=0.0)
    batch_input_per_million: float | None = F(
        None, "USD per 1M input tokens through the Batch API (`judge.mode: batch`). None = half the live price.", ge=0.0
    )
    batch_output_per_million: float | None = F(
        None, "USD per 1M output tokens through the Batch API. None = half the live price.", ge=0.0
    )


class JudgeConfig(StrictModel):
    """Which judge compares two answers, and how it is called."""

    backend: Literal["openai", "hf", "reward_model", "python"] = F(
        "openai",
        "`openai`: any OpenAI-compatible chat-completions endpoint (OpenAI, `vllm serve`, ...). `hf`: a local "
        "transformers chat model judging by next-token probabilities of the labels. `reward_model`: a local "
        "sequence-classification model scoring each answer. `python`: a `module:function` callable.",
    )
    model: str | None = F(
        None,
        "openai: the model name sent to the endpoint (e.g. `gpt-4o`). hf / reward_model: a local directory or "
        "hub id. Not used by the python backend.",
    )
    mode: Literal["live", "batch"] = F(
        "live",
        "openai: `live` sends chat-completion requests now. `batch` writes them to a JSONL file, submits it to the "
        "OpenAI Batch API (half price, separate rate limits, results within `batch_completion_window`), polls "
        "until it ends and maps the results back; for nightly runs, not interactive ones (docs/evaluation.md).",
    )
    batch_poll_initial_s: float = F(
        30.0, "batch: first wait between status polls; it doubles after each poll up to `batch_poll_max_s`.", gt=0.0
    )
    batch_poll_max_s: float = F(600.0, "batch: longest wait between two status polls.", gt=0.0)
    batch_completion_window: Literal["24h"] = F(
        "24h", "batch: the batch's completion window (the only one OpenAI offers); rows not done by then expire."
    )
    batch_max_requests: int = F(
        50_000, "batch: requests per batch file (OpenAI's limit is 50,000); more judgments go in several batches.",
        ge=1,
        le=50_000,
    )
    batch_max_bytes: int = F(
        190_000_000,
        "batch: bytes per batch file; OpenAI refuses files over 200 MB, and the default leaves room below that. "
        "More requests go in several batches; one request larger than this stops the run before any upload.",
        ge=1,
        le=200_000_000,
    )
    batch_unfinished: Literal["count", "live"] = F(
        "count",
        "batch: what happens to rows that expired, failed or were cancelled. `count`: counted as `api_error` and "
        "not cached, so the next run re-submits them in a new batch. `live`: judged at once with live requests.",
    )
    base_url: str | None = F(
        None, "openai: endpoint base URL, e.g. `http://localhost:8000/v1` for vllm. None = OpenAI's public API."
    )
    api_key_env: str | None = F(
        "OPENAI_API_KEY",
        "openai: name of the environment variable holding the API key. The key itself is never a config value "
        "and is never written anywhere. None = no key (local servers that do not check one).",
    )
    api_key_header: Literal["authorization", "api-key"] = F(
        "authorization",
        "openai, live: how the key is sent. `authorization`: `Authorization: Bearer <key>` (OpenAI, vllm). "
        "`api-key`: an `api-key: <key>` header (Azure OpenAI, with a deployment `base_url` such as "
        "`https://x.openai.azure.com/openai/deployments/gpt4o?api-version=2024-06-01`).",
    )
    organization: str | None = F(
        None,
        "openai: sent as the `OpenAI-Organization` header, as the openai client does. None = the `OPENAI_ORG_ID` "
        "environment variable, if set.",
    )
    project: str | None = F(
        None,
        "openai: sent as the `OpenAI-Project` header. None = the `OPENAI_PROJECT_ID` environment variable, if set.",
    )
    function: str | None = F(
        None,
        'python: import path `module:function`. Called as `f(prompt, answer_a, answer_b)` and returning `"A"`, '
        '`"B"` or `"tie"` (or judge text ending in a `Preferred: A|B` line); with `batched: true` called as '
        "`f(prompts, answers_a, answers_b)` and returning a list. `async def` functions are awaited.",
    )
    batched: bool = F(False, "python: call the function once per batch of `batch_size` pairs (lists in, list out).")
    template: str = F(
        "tldr",
        "Judge prompt: a built-in name (`tldr`: DPO-paper-style TL;DR summary comparison; `helpfulness`: general "
        "helpfulness; `tldr_letter`, `helpfulness_letter`: the same asking for one letter, for verdict logprobs; "
        "`math_reference`: correctness against a reference answer, see `reference_answer_column`) or the path of a "
        "template YAML file. Used by the openai and hf backends.",
    )
    temperature: float = F(
        0.0, "openai: sampling temperature of the judge. 0 makes verdicts (and the cache) stable.", ge=0.0
    )
    verdict: Literal["text", "logprobs"] = F(
        "text",
        "openai: how the verdict is read. `text`: the `Preferred: A|B` line of the reply (re-asked once if it does "
        "not parse). `logprobs`: AlpacaEval 2's weighted verdict: the template asks for one letter, the request sets "
        "`logprobs: true` and `top_logprobs`, and the verdict is the soft preference P(A) / (P(A) + P(B)) of the "
        "reply's first token; a prompt's score is that probability, not 0/0.5/1. Needs a `reply_format: letter` "
        "template (`tldr_letter`, `helpfulness_letter`) and, in both-order mode, `both_orders_rule: average`.",
    )
    top_logprobs: int = F(
        20,
        "openai, verdict logprobs: alternatives returned for the reply's first token (OpenAI allows up to 20). A "
        "letter outside them counts as probability 0, as in AlpacaEval; more of them make that rarer.",
        ge=2,
        le=20,
    )
    max_tokens: int | None = F(
        None,
        "openai: maximum tokens of the judge's reply. None = 256 with verdict text (a comparison sentence and the "
        "verdict line), 1 with verdict logprobs (only the first token is read).",
        ge=1,
    )
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = F(
        "max_tokens",
        "openai: request field carrying `max_tokens`. Newer OpenAI reasoning models need `max_completion_tokens`.",
    )
    extra_body: dict[str, Any] = F(
        {}, "openai: extra request fields (e.g. vllm sampling options). Part of the cache key."
    )
    timeout_s: float = F(60.0, "openai: seconds before a request times out (and is retried).", gt=0.0)
    max_concurrency: int = F(16, "openai: requests in flight at once.", ge=1)
    max_response_bytes: int = F(
        10 * 1024 * 1024,
        "openai, live: longest reply body accepted, in bytes (a judgment is a few KiB). A longer reply is cut off "
        "unread and the judgment is an `api_error`, not retried: a server sending megabytes will do it again.",
        ge=1024,
    )
    requests_per_minute: float | None = F(
        None,
        "openai: spread requests to at most this many per minute. None = no limit beyond `max_concurrency`.",
        gt=0.0,
    )
    max_attempts: int = F(
        6,
        "openai: attempts per request on 429, 5xx, timeouts and connection errors (1 = no retry). After the last, "
        "the judgment is counted as an `api_error`.",
        ge=1,
    )
    connect_failure_limit: int = F(
        8,
        "openai: stop the run (JudgeEndpointError) when this many requests have failed to connect before the "
        "endpoint answered once: a wrong `base_url` or a server that is down fails in seconds, not after every "
        "request's retries.",
        ge=1,
    )
    backoff_initial_s: float = F(1.0, "openai: first retry delay; it doubles each attempt, with jitter.", gt=0.0)
    backoff_max_s: float = F(
        60.0,
        "openai: cap on one retry delay, including a server's `Retry-After` (longer waits are cut to this).",
        gt=0.0,
    )
    reask_on_parse_error: bool = F(
        True,
        "Ask once more (showing the judge its reply and the required format) when the verdict line does not parse.",
    )
    tie_margin: float = F(
        0.0,
        "hf: a log-probability gap, reward_model: a score gap at or below which the verdict is a tie. "
        "0 = a tie only on exact equality.",
        ge=0.0,
    )
    batch_size: int = F(8, "hf / reward_model / batched python: pairs per forward pass or call.", ge=1)
    max_length: int = F(
        2048, "hf / reward_model: inputs longer than this many tokens are truncated from the left.", ge=8
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = F(
        "float32", "hf / reward_model: dtype the model is loaded in."
    )
    device: str = F("auto", "hf / reward_model: torch device (`auto` = CUDA when available, else CPU).")

    @field_validator("template")
    @classmethod
    def _template_exists(cls, value: str) -> str:
        from rloo_engine.evaluation.templates import check_template_name

        check_template_name(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        if self.backend in ("openai", "hf", "reward_model") and not self.model:
            what = "a model name" if self.backend == "openai" else "a local model directory or hub id"
            raise ValueError(f"model: not set; the {self.backend} judge needs {what}")
        if self.backend == "python":
            if not self.function or ":" not in self.function:
                raise ValueError(
                    f"function: {self.function!r}; the python judge needs an import path like "
                    "'my_pkg.rules:prefer_shorter'"
                )
        if self.mode == "batch" and self.backend != "openai":
            raise ValueError(f"mode: 'batch' with backend {self.backend!r}; the Batch API needs the openai backend")
        if self.mode == "batch" and self.api_key_header != "authorization":
            raise ValueError(
                f"api_key_header: {self.api_key_header!r} with mode 'batch'; the Batch API path uses the openai "
                "client, which sends `Authorization: Bearer`. Use mode: live for an api-key endpoint"
            )
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: {self.base_url!r}; expected an http:// or https:// URL")
        if self.verdict == "logprobs":
            self._check_logprobs_verdict()
        return self

    def _check_logprobs_verdict(self) -> None:
        if self.backend != "openai":
            raise ValueError(
                f"verdict: 'logprobs' with backend {self.backend!r}; only the openai backend (an OpenAI-compatible "
                "chat-completions endpoint) returns the log-probabilities of its reply (the hf judge reads label "
                "probabilities already)"
            )
        clashing = sorted({"logprobs", "top_logprobs"} & set(self.extra_body))
        if clashing:
            raise ValueError(
                f"extra_body: sets {clashing} with verdict 'logprobs'; the judge sends them itself (set "
                "judge.top_logprobs instead)"
            )

    @property
    def reply_max_tokens(self) -> int:
        """`max_tokens`, or its default for the verdict mode: one token is all a logprobs verdict reads."""
        if self.max_tokens is not None:
            return self.max_tokens
        return 1 if self.verdict == "logprobs" else 256


class EvalConfig(StrictModel):
    """All options of a win-rate evaluation. Paths of the policy / SFT models may also be given as arguments."""

    # ---------------------------------------------------------------- prompts and references
    prompts: str = F(
        ...,
        "Eval prompt set: a .jsonl/.json/.parquet/.csv file, a `save_to_disk` dataset directory or a hub id. Rows "
        "need `prompt_column` (a string, or a list of chat messages).",
    )
    split: str = F("test", "Split to read from a dataset directory or hub id (plain files have a single split).")
    prompt_column: str = F("prompt", "Column holding the prompt.")
    reference_column: str | None = F(
        None,
        "Column of the prompt set holding reference completions (e.g. human TL;DR summaries). None = no references.",
    )
    reference_completions: str | None = F(
        None, "A completions JSONL file (`prompt` or `prompt_id`, and `completion`) used as the references instead."
    )
    reference_answer_column: str | None = F(
        None,
        "Column of the prompt set holding each prompt's gold answer (e.g. a math solution), shown to the judge by a "
        "template whose `user` text has `{reference}` (`math_reference`). Not a side of any pairing: that is "
        "`reference_column`. Prompts without one are left out and counted in the report. None = no gold answers.",
    )
    max_prompts: int | None = F(None, "Evaluate only the first this many prompts (after de-duplication).", ge=1)

    # ---------------------------------------------------------------- models under evaluation
    policy_model_path: str | None = F(
        None,
        "Policy to generate completions from (local directory or hub id). Overridden by `--policy` / `policy_path`.",
    )
    policy_completions: str | None = F(None, "A completions JSONL file for the policy, instead of generating.")
    sft_model_path: str | None = F(None, "SFT model to generate completions from. Overridden by `--sft` / `sft_path`.")
    sft_completions: str | None = F(None, "A completions JSONL file for the SFT model, instead of generating.")
    generation: EvalGenerationConfig = F(EvalGenerationConfig(), "How completions are generated from model paths.")

    # ---------------------------------------------------------------- judging
    pairings: list[PairingName] | None = F(
        None,
        "Comparisons to run, each reported separately: policy_vs_reference, sft_vs_reference, policy_vs_sft. "
        "None = every pairing whose two sides are available.",
    )
    judge: JudgeConfig = F(
        ..., "The judge and how it is called (required: an evaluation never picks a paid API by default)."
    )
    order_mode: Literal["both", "single"] = F(
        "both",
        "`both`: judge every pair in both orders to cancel position bias. `single`: one order per prompt, chosen "
        "by a seeded coin flip (half the calls, no consistency measurement).",
    )
    both_orders_rule: Literal["agree", "average"] = F(
        "agree",
        "How the two orders combine in `both` mode. `agree`: a win counts only when both orders pick the same "
        "answer; disagreement is a tie. `average`: each order counts as half a judgment. Soft verdicts "
        "(`judge.verdict: logprobs`) need `average`: the prompt's score is the mean of its two orders' preferences.",
    )

    max_failed_fraction: float = F(
        0.1,
        "Fail the run (EvaluationError) when more than this share of a pairing's prompts have no verdict "
        "(parse_error + api_error) or lack a completion from one side: a rate over the few that survived is not "
        "the rate of the set. A pairing with no valid judgment always fails. 1.0 = only that.",
        ge=0.0,
        le=1.0,
    )

    # ---------------------------------------------------------------- statistics
    seed: int = F(0, "Seed of the single-order coin flips and of every bootstrap.")
    bootstrap_resamples: int = F(2000, "Bootstrap resamples of prompts for each confidence interval.", ge=1000)
    confidence_level: float = F(0.95, "Coverage of the reported confidence intervals.", gt=0.5, lt=1.0)
    length_unit: Literal["words", "chars"] = F(
        "words", "Unit of completion lengths, for the reported means and the length-controlled win rate."
    )
    lc_warning_threshold: float = F(
        0.05,
        "Warn when the length-controlled win rate differs from the raw one by more than this (the judge may be "
        "rewarding length rather than quality).",
        ge=0.0,
    )
    lc_min_overlap: float = F(
        0.05,
        "Report the length-controlled rate only when at least this share of prompts (and at least 2) lie on each "
        "side of equal length. Otherwise LC is `null` with the reason: one model is longer almost everywhere, and "
        "a rate at equal length would be extrapolated outside the data.",
        ge=0.0,
        le=0.5,
    )
    min_consistency: float = F(
        0.6,
        "Warn when fewer than this share of prompts judged in both orders get the same winner in both. With no "
        "slot preferred this is judge noise (verdicts near a coin flip on many prompts, warning `judge_noise`); "
        "with one, it is part of the position-bias warning.",
        ge=0.0,
        le=1.0,
    )
    max_first_slot_deviation: float = F(
        0.1,
        "Warn of position bias when the share of verdicts picking slot A is further than this from 50% and the "
        "slot-bias interval (prompts as clusters) excludes 0: a position-biased judge shrinks the raw rate toward "
        "50%; read the bias-corrected rate.",
        ge=0.0,
        le=0.5,
    )

    # ---------------------------------------------------------------- cost
    prices: dict[str, TokenPrice] = F(
        {},
        "Price table keyed by judge model name, USD per million tokens, e.g. "
        "`{gpt-4o: {input_per_million: 2.5, output_per_million: 10}}`. Models not listed have unknown cost.",
    )
    budget_usd: float | None = F(
        None,
        "Stop with an error before the spend of this run could pass this many dollars (needs the judge model in "
        "`prices`). Finished judgments stay cached, so a rerun with a higher budget continues. None = no budget.",
        gt=0.0,
    )

    # ---------------------------------------------------------------- outputs
    output_dir: str = F(
        "outputs/eval",
        "Where `results.json`, `judgments.jsonl` and `completions/` are written. Overridden by `--output_dir`.",
    )
    cache_path: str | None = F(
        None,
        "SQLite judgment cache. None = `<output_dir>/judge_cache.sqlite`. Point several runs at one file to "
        "share judgments (keys include the judge, template and decoding parameters).",
    )
    progress: bool = F(True, "Show progress bars for generation and judging.")

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if self.policy_model_path and self.policy_completions:
            raise ValueError("policy_model_path and policy_completions: both set; give one source for the policy")
        if self.sft_model_path and self.sft_completions:
            raise ValueError("sft_model_path and sft_completions: both set; give one source for the SFT model")
        if self.reference_column and self.reference_completions:
            raise ValueError("reference_column and reference_completions: both set; give one source for the references")
        if self.pairings is not None and len(set(self.pairings)) != len(self.pairings):
            raise ValueError(f"pairings: {self.pairings} lists a pairing twice")
        if self.pairings == []:
            raise ValueError("pairings: empty list; give at least one pairing, or null for all available")
        if self.judge.verdict == "logprobs" and self.order_mode == "both" and self.both_orders_rule != "average":
            raise ValueError(
                f"both_orders_rule: {self.both_orders_rule!r} with judge.verdict 'logprobs'; a soft verdict is a "
                "probability, not a winner that can agree or disagree: set both_orders_rule: average (the prompt's "
                "score is the mean of its two orders' preferences)"
            )
        if self.budget_usd is not None and self.judge.backend == "openai" and self.judge.model not in self.prices:
            raise ValueError(
                f"budget_usd: {self.budget_usd} needs the price of judge model {self.judge.model!r}; add it to "
                f"`prices` (known: {sorted(self.prices) or 'none'})"
            )
        return self

    def resolved_cache_path(self, output_dir: str | Path | None = None) -> Path:
        """Where the judgment cache lives for a run writing to `output_dir`."""
        if self.cache_path:
            return Path(self.cache_path)
        return Path(output_dir or self.output_dir) / "judge_cache.sqlite"


def build_eval_config(values: dict[str, Any], source: str = "EvalConfig") -> EvalConfig:
    """Validates `values` into an EvalConfig, raising ConfigError with every problem named."""
    return validated(EvalConfig, values, source)


def load_eval_config(path: str | Path, overrides: dict[str, Any] | None = None) -> EvalConfig:
    """Reads a YAML EvalConfig, applies top-level `overrides` (None values ignored) and validates it."""
    values = load_yaml(path)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return build_eval_config(values, source=str(path))
