"""An `IterableDataset` of prompts as the trainer draws them: rows in stream order, split across processes by
position, read again from the start when the stream ends, and resumable by position (the stream is read up to it).

A stream has no length, so there is no shuffle (shuffle the IterableDataset itself, with a buffer, as in
`datasets`) and a run needs `max_steps`, as in TRL. Every process reads the whole stream and keeps the rows at
its own positions, as transformers' `IterableDatasetShard` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rloo_engine.data import DataError, _validate_prompt_rows


class StreamedPrompts:
    """Row `position` of an endless pass over `stream`; positions asked for only grow (the rows between are
    other processes' and are read past). `epoch`: completed passes."""

    def __init__(self, stream: Any, where: str = "train_dataset"):
        self.stream, self.where = stream, where
        self.epoch, self._next = 0, 0  # the position the iterator yields next
        self._rows: Iterator[dict] = iter(stream)
        self._read_this_pass = 0

    def __getitem__(self, position: int) -> dict:
        if position < self._next:
            raise DataError(f"{self.where}: row {position} was asked for after the stream passed it")
        self.skip_to(position)
        return self._read()

    def skip_to(self, position: int) -> None:
        """Reads past the rows before `position` (a resumed run reads the stream again up to where it stopped)."""
        while self._next < position:
            self._read()

    def _read(self) -> dict:
        try:
            row = next(self._rows)
        except StopIteration:
            if self._read_this_pass == 0:
                raise DataError(f"{self.where}: the IterableDataset is empty; expected at least one prompt") from None
            self.epoch, self._rows, self._read_this_pass = self.epoch + 1, iter(self.stream), 0
            return self._read()
        if not isinstance(row, dict) or "prompt" not in row:
            got = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"{self.where}: row {self._next} of the stream has no 'prompt' column (got {got})")
        _validate_prompt_rows([row["prompt"]], self.where)
        self._next, self._read_this_pass = self._next + 1, self._read_this_pass + 1
        return row


class StreamSampler:
    """PromptSampler's interface over a stream: each call takes the next `n * num_processes` positions, and rank
    r its own contiguous slice, so no two ranks get the same prompt in one step."""

    def __init__(self, rows: StreamedPrompts, seed: int, rank: int = 0, num_processes: int = 1):
        self.rows, self.seed, self.rank, self.num_processes = rows, seed, rank, num_processes
        self._position = 0

    @property
    def epoch(self) -> int:
        return self.rows.epoch

    def next_indices(self, n: int) -> list[int]:
        start = self._position + self.rank * n
        self._position += n * self.num_processes
        return list(range(start, start + n))

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands. `epoch` is the reader's, which may have run past the positions handed out."""
        return {"epoch": self.rows.epoch, "position": self._position, "stream": 1, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "stream" not in state:
            raise DataError("sampler state: saved by a run over a Dataset; this run streams an IterableDataset, "
                            "so resuming would draw other prompts")
        self._position = state["position"]
        self.rows.skip_to(self._position)
