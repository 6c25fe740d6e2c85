"""The visual demo's task (issue 49): pictures of a coloured square, and a hidden gold rule about naming its colour.

An image is a 28 x 28 grey, noisy picture with one square of a colour in it; the prompt asks for the colour:

    prompt:      [{"role": "user", "content": "what colour is the square?"}] + the picture
    completion:  "the square is blue."

The gold rule (`gold_score`) stands in for a human who looks at the picture:

    colour    +1 if the reply names the square's colour and no other, -1 if it names another colour or none
    finish    +0.25 if the reply ends with a full stop

The best score is 1.25. A reply that names no colour scores as a wrong one. With 0 for it (the first rule), the
seeded run learned to look on an Intel Xeon (right colour 37.5% -> 82%) and on an AMD EPYC learned instead to name
no colour when unsure (37.5% -> 48%, gold 0.70): the lesson hung on the CPU's kernels. The SFT data is right only
half the time (`sft_completion`: the true colour with probability `SFT_ACCURACY`, else one of the others), so the
SFT policy guesses, and RLOO has to learn to look: the colour is only in the pixels, never in the prompt. The
policy trains against the rule as a reward function that reads each row's picture (`gold_reward`, TRL's `image`
keyword); the evaluation judges policy against SFT with the same rule (`gold_judge`), which is what makes the demo
checkable.
"""

from __future__ import annotations

import random
import re

import numpy as np
from PIL import Image

COLOURS = {"red": (210, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 210), "yellow": (225, 205, 40)}
QUESTIONS = ("what colour is the square?", "which colour is the shape?", "name the colour of the square.",
             "what colour do you see?")
SIDE = 28  # pixels: LLaVA's 2 x 2 patches of 14
SFT_ACCURACY = 0.5  # share of SFT replies that name the true colour; the rest name another one


def picture(colour: str, seed: int) -> Image.Image:
    """A grey, noisy SIDE x SIDE picture with one square of `colour`, its size and place drawn from `seed`."""
    rng = np.random.default_rng(seed)
    pixels = rng.normal(128, 20, (SIDE, SIDE, 3)).clip(0, 255)
    size = int(rng.integers(10, 19))
    top, left = (int(v) for v in rng.integers(0, SIDE - size + 1, 2))
    pixels[top:top + size, left:left + size] = np.array(COLOURS[colour]) + rng.normal(0, 12, (size, size, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")


def square_colour(image: Image.Image) -> str:
    """The colour of the picture's square: the palette colour nearest to its most saturated pixels."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.float32).reshape(-1, 3)
    saturation = pixels.max(1) - pixels.min(1)
    square = pixels[saturation >= np.quantile(saturation, 0.8)].mean(0)
    return min(COLOURS, key=lambda c: float(((square - np.array(COLOURS[c])) ** 2).sum()))


def named_colours(text: str) -> list[str]:
    return [word for word in re.findall(r"[a-z]+", text.lower()) if word in COLOURS]


def gold_score(completion: str, colour: str) -> float:
    """The hidden rule: +1 for naming the square's colour alone, -1 for naming another or none, +0.25 for a full
    stop."""
    named = set(named_colours(completion))
    score = 1.0 if named == {colour} else -1.0
    return score + (0.25 if completion.strip().endswith(".") else 0.0)


def completion_text(completion) -> str:
    """A completion as text: TRL passes conversational completions as [{"role": "assistant", "content": ...}]."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def gold_reward(completions, image, **kwargs) -> list[float]:
    """The rule as a reward function: it reads each row's picture (the dataset's `image` column)."""
    return [gold_score(completion_text(c), square_colour(i)) for c, i in zip(completions, image)]


def sft_completion(colour: str, rng: random.Random) -> str:
    """A fluent reply that names the true colour with probability SFT_ACCURACY, else another colour."""
    named = colour if rng.random() < SFT_ACCURACY else rng.choice([c for c in COLOURS if c != colour])
    return rng.choice(("the square is {}.", "it is {}.", "i see a {} square.")).format(named)


def rows(n: int, seed: int) -> list[dict]:
    """`n` (prompt, image, colour) rows: every colour equally often, pictures and questions drawn from `seed`."""
    rng = random.Random(seed)
    colours = [list(COLOURS)[i % len(COLOURS)] for i in range(n)]
    rng.shuffle(colours)
    return [{"prompt": [{"role": "user", "content": rng.choice(QUESTIONS)}],
             "image": picture(colour, seed * 1_000_003 + i), "colour": colour} for i, colour in enumerate(colours)]


def corpus() -> list[str]:
    """The text the demo's tokenizer is trained on: every question and reply form, every colour."""
    replies = [form.format(c) for c in COLOURS for form in ("the square is {}.", "it is {}.", "i see a {} square.")]
    return list(QUESTIONS) * 20 + replies * 20
