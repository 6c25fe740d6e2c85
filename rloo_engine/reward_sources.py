"""Reward sources (a reward model, `module:function` reward functions) and their weighted combination."""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rloo_engine.config import RLOOConfig
from rloo_engine.config_base import ConfigError
from rloo_engine.data import completion_text, is_conversational
from rloo_engine.distributed import is_shard
from rloo_engine.fast_path import FLOAT32_TOLERANCE, HALF_PRECISION_TOLERANCE, fast_path_holds, stderr
from rloo_engine.import_paths import load_callable
from rloo_engine.models import DTYPES, empty_model
from rloo_engine.prompt_sharing import common_prefix_length, shared_prefix_scores


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names the source."""


@runtime_checkable
class RewardSource(Protocol):
    """Scores completions: one float, or None for "cannot judge this one", per completion.

    `prompts` are the raw dataset prompts (strings or message lists), `columns` the dataset's
    other columns, each a list aligned with `completions`, plus in training TRL's `trainer_state`,
    `log_extra` and `log_metric` (`reward_context.py`).
    """

    name: str

    def __call__(
        self, prompts: list, completions: list[str], completion_ids: list[list[int]], **columns: list
    ) -> list[float | None]: ...


# ---------------------------------------------------------------- reward model


class RewardModelSource:
    """An `AutoModelForSequenceClassification` (num_labels=1) scoring prompt + completion with its own tokenizer.

    The text is rebuilt from strings and re-tokenized, so the reward model's tokenizer may differ
    from the policy's. Rows are batched longest first, so a batch pads to rows of similar length.
    The score is read at the last real token of each row, found from the
    attention mask, so it is the same with left or right padding and whatever the pad token is.
    """

    name = "reward_model"

    def __init__(
        self,
        path_or_id: str,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        batch_size: int = 16,
        max_length: int = 1024,
        share_prompts: bool = True,
        say=stderr,
        trust_remote_code: bool = False,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        weights: bool = True,
    ):
        """`model`/`tokenizer`: objects given to `RLOOTrainer(reward_funcs=..., reward_processing_classes=...)`,
        used instead of loading `path_or_id` (then only their label). `weights=False`: the model without its
        weights (`models.empty_model`), sent them when the launch shards it; nothing is probed until then."""
        code = {"trust_remote_code": trust_remote_code}  # `trust_remote_code` of the run, as TRL applies it here too
        num_labels = model.config.num_labels if model is not None else _load_or_raise(
            path_or_id, lambda: AutoConfig.from_pretrained(path_or_id, **code)).num_labels
        if num_labels != 1:
            raise ConfigError(
                f"reward_model: {path_or_id} has num_labels={num_labels}; a reward model must have num_labels=1"
            )
        self.path, self.device = path_or_id, torch.device(device)
        self.batch_size, self.max_length = batch_size, max_length
        self.tokenizer = tokenizer or _load_or_raise(path_or_id, lambda: AutoTokenizer.from_pretrained(path_or_id, **code))
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise ConfigError(f"reward_model: {path_or_id} tokenizer has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Left truncation keeps the end of the completion, which is where the score is read.
        self.tokenizer.truncation_side = "left"
        empty = not weights and model is None
        load = (lambda path, **kwargs: empty_model(AutoModelForSequenceClassification, path, **kwargs)) if empty \
            else AutoModelForSequenceClassification.from_pretrained
        self.model = model if model is not None else _load_or_raise(
            path_or_id, lambda: load(path_or_id, dtype=dtype, **code)
        )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if empty:
            self.share_prompts = False  # its probe needs weights; FSDP2, the one launch without them, turns it off
            return
        self.model.to(self.device).eval()
        # A decoder reward model scores a group's common prompt tokens once (prompt_sharing.py), where it can
        # be checked to give the whole rows' scores; encoders (RoBERTa) and other heads score rows whole.
        tolerance = FLOAT32_TOLERANCE if self.model.dtype == torch.float32 else HALF_PRECISION_TOLERANCE
        self.share_prompts = share_prompts and fast_path_holds(
            "share_prompt_forward (reward model)", self._sharing_difference, tolerance, "scoring every row whole", say)

    def place(self, model: torch.nn.Module, say=stderr) -> None:
        """Scores with `model`, this source's model as the launch placed it. FSDP2 shards turn the shared-prompt path
        off: it calls the model's parts (decoder, score head), and a sharded module is whole only inside its own
        forward."""
        self.model = model
        if self.share_prompts and any(is_shard(p) for p in model.parameters()):
            self.share_prompts = False
            say("rloo-engine: share_prompt_forward (reward model): off under FSDP2 (the shared path runs the model's "
                "parts, a sharded module is whole only inside its own forward); scoring every row whole")

    def text(self, prompt: str | list[dict], completion: str | list[dict]) -> str:
        """The string the reward model judges: prompt + completion, or the full chat with the reply."""
        if not is_conversational(prompt):
            return prompt + completion_text(completion)
        reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        chat = list(prompt) + reply
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        return "\n".join(f"{m['role']}: {m['content']}" for m in chat)

    def __call__(
        self, prompts: list, completions: list[str], completion_ids: list[list[int]] | None = None, **columns: list
    ) -> list[float]:
        # A chat template writes its own special tokens; adding them again would double e.g. BOS.
        add_special = not is_conversational(prompts[0]) if prompts else True
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length,
                             add_special_tokens=add_special)["input_ids"]
        shared = [r for r in _prompt_runs(prompts, self.batch_size)
                  if len(r) > 1 and common_prefix_length(ids[r.start:r.stop])] if self.share_prompts else []
        alone = sorted(set(range(len(ids))) - {i for r in shared for i in r})
        scores = [0.0] * len(ids)
        for rows, values in ((alone, self._score_rows([ids[i] for i in alone])),
                             ([i for r in shared for i in r], self._score_shared(ids, shared))):
            for row, score in zip(rows, values, strict=True):
                scores[row] = score
        return scores

    def _score_rows(self, ids: list[list[int]]) -> list[float]:
        """Each row whole. Batches of similar lengths pad less: rows are scored longest first, then put back."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        scores = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            for row, score in zip(rows, self._score_batch([ids[i] for i in rows]), strict=True):
                scores[row] = score
        return scores

    def _score_shared(self, ids: list[list[int]], runs: list[range]) -> list[float]:
        """The rows of `runs` (each sharing a prompt's first tokens), in order, at most `batch_size` rows a forward."""
        scores: list[float] = []
        batch: list[range] = []
        for k, run in enumerate(runs):
            batch.append(run)
            if k + 1 == len(runs) or sum(map(len, batch)) + len(runs[k + 1]) > self.batch_size:
                rows = [ids[i] for r in batch for i in r]
                local, start = [], 0
                for r in batch:
                    local.append(range(start, start + len(r)))
                    start += len(r)
                scores += shared_prefix_scores(self.model, self.tokenizer.pad_token_id, rows, local).cpu().tolist()
                batch = []
        return scores

    def _sharing_difference(self) -> float | str:
        """Largest |score difference| between the shared-prefix and the plain path on a fixed probe (two prompts, two
        continuations each), or why sharing cannot run this model."""
        vocab = self.model.config.vocab_size
        rows = [[(7919 * i + 13 * j) % vocab for i in range(8 + j % 2)] for j in (0, 0, 1, 1)]
        for j in (1, 3):
            rows[j][6:] = [(rows[j][k] + 1) % vocab for k in range(6, len(rows[j]))]  # same prompt, other reply
        shared = shared_prefix_scores(self.model, self.tokenizer.pad_token_id, rows, [range(0, 2), range(2, 4)])
        if shared is None:
            return "the model has no prompt cache to share (an encoder, or another head)"
        return (shared.cpu() - torch.tensor(self._score_batch(rows))).abs().max().item()

    @torch.no_grad()  # not inference_mode: FSDP2 cannot reuse parameters it unsharded in it ("Inference tensors do
    def _score_batch(self, ids: list[list[int]]) -> list[float]:  # not track version counter", seen at 1 process)
        # Padded on the right whatever the tokenizer's padding side: every real token then keeps the position it
        # has unpadded under the model's own numbering (0.. for decoders, after padding_idx for RoBERTa and
        # XLM-R), so no position ids are passed and each family numbers its own.
        width = max(map(len, ids))
        input_ids = torch.tensor([row + [self.tokenizer.pad_token_id] * (width - len(row)) for row in ids])
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in ids])  # (B, T)
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        per_token = _PerTokenLogits(self.model)
        with per_token:
            out = self.model(input_ids=input_ids, attention_mask=mask)
        if per_token.logits is None:  # a head that pools itself (e.g. [CLS]): trust its pooled logits
            return out.logits[:, 0].float().cpu().tolist()
        last_real = (torch.arange(mask.shape[1], device=mask.device) * mask).argmax(-1)  # (B,)
        rows = torch.arange(mask.shape[0], device=mask.device)
        return per_token.logits[rows, last_real, 0].float().cpu().tolist()


def _prompt_runs(prompts: list, most: int) -> list[range]:
    """Consecutive rows with the same prompt (a generation batch repeats each prompt G times), at most `most`
    rows a run (one forward)."""
    runs, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start] or i - start == most:
            runs.append(range(start, i))
            start = i
    return runs


class _PerTokenLogits:
    """Captures the score head's per-position output (B, T, 1), so pooling uses our attention mask.

    HF pools at the rightmost token that is not `pad_token_id`, which is wrong when a real token
    equals the pad token (e.g. pad = eos and the text ends in eos).
    """

    def __init__(self, model: torch.nn.Module):
        self.head = getattr(model, "score", None)
        self.logits: torch.Tensor | None = None
        self._handle = None

    def _hook(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        if output.dim() == 3:
            self.logits = output

    def __enter__(self) -> _PerTokenLogits:
        if isinstance(self.head, torch.nn.Module):
            self._handle = self.head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._handle is not None:
            self._handle.remove()


def _load_or_raise(path: str, load: Any) -> Any:
    try:
        return load()
    except Exception as err:
        raise ConfigError(
            f"reward_model_name_or_path: {path} could not be loaded: {type(err).__name__}: {err}"
        ) from err


# ---------------------------------------------------------------- reward functions


class FunctionRewardSource:
    """A user function `fn(prompts=, completions=, completion_ids=, **columns, trainer_state=, log_extra=,
    log_metric=) -> list[float | None]`, sync or async."""

    def __init__(self, import_path: str, fn: Any):
        # Metrics use the bare function name, as TRL does (`rewards/<name>/mean`); errors use the full path.
        self.import_path, self.fn = import_path, fn
        self.name = import_path.rpartition(":")[2].rpartition(".")[2]

    @classmethod
    def of_callable(cls, fn: Any) -> FunctionRewardSource:
        """A function (or callable object) given to `RLOOTrainer(reward_funcs=...)`, labelled `module:qualname`."""
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
        return cls(f"{getattr(fn, '__module__', None) or type(fn).__module__}:{name}", fn)

    def __call__(
        self, prompts: list, completions: list[str], completion_ids: list[list[int]], **columns: list
    ) -> list[float | None]:
        result = self.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        return _run(result) if inspect.isawaitable(result) else result


def load_reward_function(import_path: str) -> FunctionRewardSource:
    """Imports `package.module:function` and wraps it as a reward source named by its import path."""
    return FunctionRewardSource(import_path, load_callable(import_path, "reward_funcs"))


# Async reward functions often hold clients (HTTP, OpenAI) bound to the loop they first ran on, so every
# call reuses one long-lived loop. It runs in its own thread, so callers may themselves be inside a loop.
_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _reward_loop() -> asyncio.AbstractEventLoop:
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="reward-loop", daemon=True).start()
        return _LOOP


def _run(awaitable: Any) -> Any:
    async def wrap() -> Any:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(wrap(), _reward_loop()).result()


def score_all(
    sources: Sequence[RewardSource], prompts: list, completions: list[str], completion_ids: list[list[int]],
    columns: dict[str, list], context: dict[str, Any] | None = None,
) -> list[Any]:
    """Each source's raw output, in order; async sources run concurrently, sync ones one after another.

    `context`: keyword arguments beside the batch and the columns (TRL's `trainer_state`, `log_extra`,
    `log_metric`: `reward_context.py`). A source that raises yields its exception in place of a result, so the
    caller can name it.
    """
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns,
                  **(context or {}))
    results: list[Any] = [None] * len(sources)
    pending: dict[int, Any] = {}
    for i, source in enumerate(sources):
        try:
            out = source.fn(**kwargs) if isinstance(source, FunctionRewardSource) else source(**kwargs)
        except Exception as err:
            out = err
        if inspect.isawaitable(out):
            pending[i] = out
        else:
            results[i] = out
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*pending.values(), return_exceptions=True)

        for i, out in zip(pending, _run(gather())):
            results[i] = out
    return results


# ---------------------------------------------------------------- combination


@dataclass
class RewardResult:
    """Rewards of N completions from S sources.

    rewards: (N,) float32, weighted sum over the sources that scored each row (0.0 where none did),
        clipped to `reward_clip_range`.
    per_source: (N, S) float32, each source's raw score, NaN where it returned None.
    scorable: (N,) bool, False where no source scored the row.
    names: S source names, in column order.
    """

    rewards: torch.Tensor
    per_source: torch.Tensor
    scorable: torch.Tensor
    names: list[str]


def compute_rewards(
    sources: Sequence[RewardSource],
    weights: Sequence[float] | None,
    clip_range: tuple[float, float] | None,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    context: dict[str, Any] | None = None,
) -> RewardResult:
    """Scores N completions with every source, sums them with `weights`, and clips the sum to `clip_range` (as TRL).
    `context`: passed to every source beside the batch (`score_all`)."""
    if not sources:
        raise RewardError("reward sources: none given; expected a reward model or at least one reward function")
    weights = [1.0] * len(sources) if weights is None else list(weights)
    if len(weights) != len(sources):
        raise RewardError(f"reward_weights: {weights} has {len(weights)} entries; expected {len(sources)}, one per source")
    n = len(completions)
    labels = _source_labels(sources)
    raw = score_all(sources, prompts, completions, completion_ids, columns, context)
    per_source = torch.tensor(
        [_checked_scores(label, out, n) for label, out in zip(labels, raw)], dtype=torch.float32
    ).T.reshape(n, len(sources))  # (N, S)
    weighted = per_source * torch.tensor(weights, dtype=torch.float32)  # (N, S)
    rewards = weighted.nansum(dim=1)
    if clip_range is not None:
        rewards = rewards.clamp(clip_range[0], clip_range[1])
    return RewardResult(
        rewards=rewards,
        per_source=per_source,
        scorable=~per_source.isnan().all(dim=1),
        names=[s.name for s in sources],
    )


def _source_labels(sources: Sequence[RewardSource]) -> list[str]:
    """Names as the config spells them: `reward_model`, then `reward_funcs[i] module:function`."""
    labels, func_index = [], 0
    for source in sources:
        if isinstance(source, RewardModelSource):
            labels.append(f"reward_model {source.path}")
        else:
            labels.append(f"reward_funcs[{func_index}] {getattr(source, 'import_path', source.name)}")
            func_index += 1
    return labels


def _checked_scores(label: str, out: Any, n: int) -> list[float]:
    """`out` as N floats (None and NaN -> NaN), or a RewardError saying what was wrong."""
    if isinstance(out, BaseException):
        raise RewardError(f"{label} raised {type(out).__name__}: {out}") from out
    if isinstance(out, torch.Tensor) or hasattr(out, "tolist"):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise RewardError(f"{label} returned a {type(out).__name__}; expected a list of {n} floats (or None)")
    if len(out) != n:
        raise RewardError(f"{label} returned {len(out)} values; expected {n}, one per completion")
    scores = []
    for i, value in enumerate(out):
        if value is None:
            scores.append(math.nan)
        elif isinstance(value, Real):
            if math.isinf(value):
                raise RewardError(f"{label} returned {value} at row {i}; expected a finite float or None")
            scores.append(float(value))
        else:
            raise RewardError(f"{label} returned a {type(value).__name__} at row {i}; expected a float or None")
    return scores


class RewardSourceSilent(RewardError, ConfigError):
    """A reward source scored nothing for `reward_source_max_empty_steps` batches; a retry would fail the same way."""


class EmptySourceWatch:
    """Warns for each generation batch in which a source scores none of its completions, fails after `limit` in a row.

    Per process: each process checks the sources on its own completions. `limit` 0 only warns.
    """

    def __init__(self, sources: Sequence[RewardSource], limit: int):
        self.labels, self.limit = _source_labels(sources), limit
        self.empty_batches = [0] * len(self.labels)

    def observe(self, result: RewardResult, step: int) -> None:
        scored = (~result.per_source.isnan()).sum(dim=0).tolist()  # (S,)
        n = result.per_source.shape[0]
        for j, label in enumerate(self.labels):
            if scored[j]:
                self.empty_batches[j] = 0
                continue
            self.empty_batches[j] += 1
            run = self.empty_batches[j]
            limit = f"the run fails at {self.limit}" if self.limit else "only warned: the limit is 0"
            print(f"rloo-engine: warning: step {step}: {label} scored none of its {n} completions (every value None "
                  f"or NaN); {run} batch(es) in a row, {limit} (reward_source_max_empty_steps)", file=sys.stderr)
            if self.limit and run >= self.limit:
                raise RewardSourceSilent(
                    f"{label} scored none of its completions for {run} generation batches in a row (every value "
                    "None or NaN), so it adds no training signal; fix the source, or raise "
                    "reward_source_max_empty_steps (0 = only warn)"
                )


# ---------------------------------------------------------------- from the config


def build_reward_sources(cfg: RLOOConfig, device: str | torch.device, say=stderr, given: list | None = None,
                         tokenizers: list | None = None, weights: bool = True) -> list[RewardSource]:
    """The reward model first (if configured), then each of `reward_funcs`, matching `reward_weights`. `given`:
    `RLOOTrainer(reward_funcs=...)`'s list instead of `reward_funcs`, as TRL takes it: `module:function` paths,
    reward model ids or directories, sequence-classifier objects (scored with `tokenizers[i]`), callables.
    `weights=False`: reward models loaded from a path come without their weights (`RewardModelSource`)."""
    def reward_model(path: str, model: Any = None, tokenizer: Any = None) -> RewardModelSource:
        return RewardModelSource(path, device=device, dtype=DTYPES[cfg.dtype], share_prompts=cfg.share_prompt_forward,
                                 say=say, trust_remote_code=cfg.trust_remote_code, model=model, tokenizer=tokenizer,
                                 weights=weights)

    sources: list[RewardSource] = []
    if cfg.reward_model_name_or_path:
        sources.append(reward_model(cfg.reward_model_name_or_path))
    for i, item in enumerate(cfg.reward_funcs if given is None else given):
        tokenizer = tokenizers[i] if tokenizers else None
        if isinstance(item, str) and ":" in item:
            sources.append(load_reward_function(item))
        elif isinstance(item, (str, torch.nn.Module)):
            path = item if isinstance(item, str) else getattr(item, "name_or_path", "") or type(item).__name__
            source = reward_model(path, None if isinstance(item, str) else item, tokenizer)
            source.name = path.rstrip("/").split("/")[-1]  # TRL names a reward model by its id's last part
            sources.append(source)
        else:
            sources.append(FunctionRewardSource.of_callable(item))
    return sources
