"""The prompts of each generation batch, drawn in order, and the one batch that may be in flight on a vLLM server
(`async_generation`): what a checkpoint must say about them, and what a run must finish before it ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rloo_engine.data import PromptSampler, is_conversational
from rloo_engine.generation.base import GenerationBackend, Rollout
from rloo_engine.vision import row_images, with_image_items


@dataclass
class PromptDraw:
    """One generation batch's prompts, drawn before they are generated (with `async_generation`, a batch ahead)."""

    rows: list[dict]
    rendered: list[str]
    conversational: bool
    weights_step: int  # the optimizer step whose weights generate it
    sampler_state: dict  # the prompt sampler before this draw, for a checkpoint taken while it is in flight
    request: Any = None  # the server request `submit` sent (async_generation); None: generated when collected
    images: list[list] | None = None  # each prompt's images (PIL), with a vision-language model

    @property
    def image_kwargs(self) -> dict:
        """What a backend's `generate` / `submit` is given of the images: nothing for a text-only model."""
        return {} if self.images is None else {"images": self.images}


class PromptFeed:
    """Draws `num_prompts` prompts a batch from `sampler`; with `submit_ahead` (async generation) each draw goes to
    the backend at once, and `prefetch` keeps the next batch generating while the trainer works on this one.
    With `vision` (a vision-language model) each row's images are drawn with it, and its prompt gets an image item
    per image before it is rendered."""

    def __init__(self, dataset, sampler: PromptSampler, render: Callable[[Any], str], num_prompts: int,
                 num_generations: int, backend: Callable[[], GenerationBackend], submit_ahead: bool,
                 vision: bool = False):
        self.dataset, self.sampler, self.render, self.vision = dataset, sampler, render, vision
        self.num_prompts, self.num_generations = num_prompts, num_generations
        self._backend, self.submit_ahead = backend, submit_ahead  # the trainer's current one (it may be swapped)
        self.in_flight: PromptDraw | None = None
        self.last_taken: PromptDraw | None = None  # the draw the trainer's current batch came from

    @property
    def backend(self) -> GenerationBackend:
        return self._backend()

    def _draw(self, weights_step: int) -> PromptDraw:
        before = self.sampler.state_dict()
        rows = [self.dataset[i] for i in self.sampler.next_indices(self.num_prompts)]
        images = [row_images(r, "train_dataset") for r in rows] if self.vision else None
        prompts = ([with_image_items(r["prompt"], len(i)) for r, i in zip(rows, images)] if images is not None
                   else [r["prompt"] for r in rows])
        draw = PromptDraw(rows, [self.render(p) for p in prompts], is_conversational(rows[0]["prompt"]),
                          weights_step, before, images=images)
        if self.submit_ahead:
            # A chat template writes its own special tokens (BOS); plain prompts get the tokenizer's.
            draw.request = self.backend.submit(draw.rendered, self.num_generations,
                                               add_special_tokens=not draw.conversational, **draw.image_kwargs)
        return draw

    def take(self, weights_step: Callable[[], int]) -> PromptDraw:
        """The batch in flight, else a new draw; `weights_step()` gives the backend this step's weights first."""
        draw, self.in_flight = self.in_flight or self._draw(weights_step()), None
        self.last_taken = draw
        return draw

    def prefetch(self, weights_step: Callable[[], int]) -> None:
        """Sends the next batch now, so it generates while this one is scored and trained on."""
        self.in_flight = self._draw(weights_step())

    def rollout(self, draw: PromptDraw) -> Rollout:
        """`draw`'s completions: collected from the server (sent ahead) or generated now."""
        if draw.request is not None:
            return self.backend.collect(draw.request)
        return self.backend.generate(draw.rendered, self.num_generations, add_special_tokens=not draw.conversational,
                                     **draw.image_kwargs)

    def drain(self) -> None:
        """Waits for a batch the run turned out not to need: the server must finish it before new weights."""
        if self.in_flight is not None:
            self.rollout(self.in_flight)
            self.in_flight = None

    def state_dict(self) -> dict:
        """The sampler as a checkpoint keeps it: before the batch in flight, so a resumed run draws it again."""
        return self.in_flight.sampler_state if self.in_flight is not None else self.sampler.state_dict()
