"""The demo's synthetic task: themed prompts over a small vocabulary, and the hidden "gold" preference rule.

A prompt asks for a line about a theme; a completion is one or more short sentences:

    prompt:      "tell me about the night for a child, in the evening.\n"
    completion:  "the golden moon rests over the old lake. there is a owl by the star."

The gold rule (`gold_score`) stands in for human preference. It adds up independent, dense
terms, so the completions sampled for one prompt almost always differ in score and RLOO gets a
signal at every step:

    adjectives  +0.5 per vivid adjective (bright, golden, ...; counted up to 3), -0.25 per plain one (big, old, ...)
    length      -0.2 per word outside the 8..16 word window
    finish      +0.5 if the text ends with a full stop (a completion cut off at the token limit does not)
    fluency     -0.5 per word outside the completion vocabulary (broken or invented words)

The best score is 2.0. Every term is a count of words or a length, never a comparison between
two positions (such as "mentions the prompt's theme" or "repeats a word"): a reward model of a
million parameters learns count terms in a minute on CPU, but in our measurements it could not
learn theme matching at all in that budget, and a term the reward model cannot see is one RLOO
cannot climb; it only gives the policy room to drift. So the theme, audience and time of day of
a prompt make prompts diverse and completions natural, but they do not enter the rule.

The SFT data (`sft_completion`) is fluent but mediocre under the rule: it mostly uses plain
adjectives and often rambles past the length window, so its completions are cut off. Each
improvement is a shift in word choice or stopping time, not a new skill, so RLOO can climb it in
a few hundred steps. The policy never sees the rule: it trains against a reward model fitted to
gold-labelled preference pairs, and the rule comes back only as the evaluation's judge.
"""

from __future__ import annotations

import itertools
import random
import re

# ---------------------------------------------------------------- vocabulary

THEMES = {
    "night": ("moon", "star", "owl", "cloud"),
    "water": ("river", "lake", "fish", "boat"),
    "farm": ("horse", "dog", "field", "hill"),
    "spring": ("flower", "bee", "tree", "bird"),
    "town": ("house", "road", "cat", "bell"),
    "woods": ("fox", "forest", "frog", "deer"),
}
NOUNS = tuple(n for nouns in THEMES.values() for n in nouns)
VIVID = ("bright", "golden", "gentle", "sparkling", "warm", "peaceful")
PLAIN = ("big", "small", "old", "red", "blue", "green", "brown", "little")
VERBS = ("sleeps", "runs", "sits", "waits", "rests", "plays", "shines", "grows", "walks", "glows")
PREPOSITIONS = ("near", "under", "over", "by", "beside", "behind")
FUNCTION_WORDS = ("the", "a", "is", "there")
VOCABULARY = frozenset(NOUNS + VIVID + PLAIN + VERBS + PREPOSITIONS + FUNCTION_WORDS)  # of completions

INSTRUCTIONS = ("describe", "write about", "tell me about", "say something about")
AUDIENCES = ("child", "friend", "teacher", "poet", "stranger", "neighbour", "sailor", "farmer")
TIMES = ("morning", "evening", "afternoon", "winter")

# ---------------------------------------------------------------- the gold rule

VIVID_WEIGHT = 0.5
VIVID_CAP = 3
PLAIN_WEIGHT = 0.25
LENGTH_WINDOW = (8, 16)
LENGTH_WEIGHT = 0.2
FINISH_BONUS = 0.5
UNKNOWN_WORD_WEIGHT = 0.5
TIE_MARGIN = 0.1  # gold differences below this are a tie for `gold_judge`

_WORD = re.compile(r"[a-z]+")


def words(text: str) -> list[str]:
    """Lower-case alphabetic words of `text` (punctuation and whitespace dropped)."""
    return _WORD.findall(text.lower())


def prompt_theme(prompt: str) -> str | None:
    """The theme a prompt asks about (its first theme word), or None when it names none."""
    return next((w for w in words(prompt) if w in THEMES), None)


def gold_breakdown(prompt: str, completion: str) -> dict[str, float]:
    """Each term of the gold score (see the module docstring); `gold_score` is their sum.

    `prompt` is not used by the current rule; it is part of the signature so a rule may use it.
    """
    ws = words(completion)
    lo, hi = LENGTH_WINDOW
    return {
        "adjectives": VIVID_WEIGHT * min(sum(w in VIVID for w in ws), VIVID_CAP)
        - PLAIN_WEIGHT * sum(w in PLAIN for w in ws),
        "length": -LENGTH_WEIGHT * (max(0, lo - len(ws)) + max(0, len(ws) - hi)),
        "finish": FINISH_BONUS if completion.rstrip().endswith(".") else 0.0,
        "fluency": -UNKNOWN_WORD_WEIGHT * sum(w not in VOCABULARY for w in ws),
    }


def gold_score(prompt: str, completion: str) -> float:
    """The hidden preference: higher is better, at most 2.0."""
    return sum(gold_breakdown(prompt, completion).values())


def gold_judge(prompt: str, answer_a: str, answer_b: str) -> str:
    """The `python` judge backend's form: "A" or "B" for the higher gold score, "tie" within TIE_MARGIN."""
    a, b = gold_score(prompt, answer_a), gold_score(prompt, answer_b)
    if abs(a - b) < TIE_MARGIN:
        return "tie"
    return "A" if a > b else "B"


def gold_reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """The gold rule as an RLOO reward function (`rloo_engine.demo.toy_task:gold_reward`), for monitoring and ablations."""
    return [gold_score(p, c) for p, c in zip(prompts, completions, strict=True)]


# ---------------------------------------------------------------- prompts

PromptSpec = tuple[str, str, str, str]  # (instruction, theme, audience, time)


def make_prompt(spec: PromptSpec) -> str:
    instruction, theme, audience, time = spec
    return f"{instruction} the {theme} for a {audience}, in the {time}.\n"


def prompt_specs(seed: int, eval_fraction: float = 0.25) -> tuple[list[PromptSpec], list[PromptSpec]]:
    """(train, eval) prompt specs, split at random: eval prompts never appear in SFT, reward or RLOO data."""
    specs = list(itertools.product(INSTRUCTIONS, THEMES, AUDIENCES, TIMES))
    random.Random(seed).shuffle(specs)
    n_eval = max(1, round(eval_fraction * len(specs)))
    return specs[n_eval:], specs[:n_eval]


def sample_prompt(rng: random.Random, specs: list[PromptSpec]) -> str:
    return make_prompt(rng.choice(specs))


# ---------------------------------------------------------------- completions


def _noun(rng: random.Random, theme: str | None, p_theme: float) -> str:
    return rng.choice(THEMES[theme]) if theme and rng.random() < p_theme else rng.choice(NOUNS)


def _adjective(rng: random.Random, p_adjective: float, p_vivid: float) -> list[str]:
    if rng.random() >= p_adjective:
        return []
    return [rng.choice(VIVID if rng.random() < p_vivid else PLAIN)]


def _sentence(rng: random.Random, theme: str | None, p_theme: float, p_adjective: float, p_vivid: float) -> str:
    def np_() -> list[str]:
        return _adjective(rng, p_adjective, p_vivid) + [_noun(rng, theme, p_theme)]

    form = rng.randrange(3)
    if form == 0:  # the old cat sleeps near the river.
        ws = ["the", *np_(), rng.choice(VERBS), rng.choice(PREPOSITIONS), "the", *np_()]
    elif form == 1:  # a fox is under the green tree.
        ws = ["a", *np_(), "is", rng.choice(PREPOSITIONS), "the", *np_()]
    else:  # there is a bright moon over the hill.
        ws = ["there", "is", "a", *np_(), rng.choice(PREPOSITIONS), "the", *np_()]
    return " ".join(ws) + "."


def completion(
    rng: random.Random,
    prompt: str,
    p_theme: float,
    p_adjective: float,
    p_vivid: float,
    sentence_weights: tuple[float, ...],
) -> str:
    """Sentences from the task grammar.

    Each noun is on the prompt's theme with chance `p_theme` (else any noun), each noun has an
    adjective with chance `p_adjective`, which is vivid with chance `p_vivid`, and
    `sentence_weights[k]` is the relative chance of k+1 sentences.
    """
    theme = prompt_theme(prompt)
    n = rng.choices(range(1, len(sentence_weights) + 1), weights=sentence_weights)[0]
    return " ".join(_sentence(rng, theme, p_theme, p_adjective, p_vivid) for _ in range(n))


def sft_completion(rng: random.Random, prompt: str) -> str:
    """Fluent but mediocre: mostly plain adjectives, and 40% run to three sentences (past the length window)."""
    return completion(rng, prompt, p_theme=0.35, p_adjective=0.6, p_vivid=0.2, sentence_weights=(0.25, 0.35, 0.4))


def reference_completion(rng: random.Random, prompt: str, candidates: int = 4) -> str:
    """A decent human-like answer: the best under the gold rule of a few careful-writer drafts."""
    drafts = [
        completion(rng, prompt, p_theme=0.6, p_adjective=0.7, p_vivid=0.4, sentence_weights=(0.2, 0.6, 0.2))
        for _ in range(candidates)
    ]
    return max(drafts, key=lambda text: gold_score(prompt, text))


def varied_completion(rng: random.Random, prompt: str) -> str:
    """Any style, from poor to excellent, sometimes cut off mid-sentence (as at max_completion_length).

    Reward-model pairs come from here and from `edited_completion` rather than from `sft_completion`
    alone, so the reward model has also seen the better region the policy moves into.
    """
    text = completion(
        rng, prompt,
        p_theme=rng.random(), p_adjective=rng.uniform(0.3, 1.0), p_vivid=rng.random(),
        sentence_weights=(0.3, 0.4, 0.2, 0.1),
    )
    if rng.random() < 0.15:
        ws = text.split()
        text = " ".join(ws[: rng.randint(1, len(ws))]).rstrip(".")
    return text


# Each edit kind and how often `edited_completion` picks it: word choice, which a small reward
# model learns slowly, comes up more often than length, finish and junk, which it learns fast.
EDITS = {"vivid": 2, "plain": 2, "drop_adjective": 1, "truncate": 1, "extend": 1, "junk": 0.5}


def edited_completion(rng: random.Random, prompt: str, text: str, kind: str | None = None) -> str:
    """`text` with one small edit that moves one gold term (`kind`, random if None; see EDITS).

    A pair (text, edited) differs in one term only, which teaches a small reward model each term
    of the rule instead of mostly the one with the largest spread (length).
    """
    kind = kind or rng.choices(list(EDITS), weights=list(EDITS.values()))[0]
    tokens = text.split()
    cores = [t.rstrip(".") for t in tokens]

    def replace(candidates: list[int], new: str) -> str:
        if candidates:
            i = rng.choice(candidates)
            tokens[i] = new + tokens[i][len(cores[i]):]
        return " ".join(tokens)

    if kind == "vivid":
        return replace([i for i, w in enumerate(cores) if w in PLAIN], rng.choice(VIVID))
    if kind == "plain":
        return replace([i for i, w in enumerate(cores) if w in VIVID], rng.choice(PLAIN))
    if kind == "drop_adjective":
        adjectives = [i for i, w in enumerate(cores) if w in PLAIN or w in VIVID]
        if adjectives:
            del tokens[rng.choice(adjectives)]
        return " ".join(tokens)
    if kind == "truncate":
        return " ".join(tokens[: rng.randint(1, max(1, len(tokens) - 1))]).rstrip(".")
    if kind == "extend":
        return text + " " + completion(rng, prompt, rng.random(), 0.6, rng.random(), (1.0,))
    if kind == "junk":  # an invented word, as an undertrained model writes
        return replace(list(range(len(tokens))), cores[rng.randrange(len(cores))][:2] + rng.choice(NOUNS)[:3])
    raise ValueError(f"kind: {kind!r}; expected one of {list(EDITS)}")
