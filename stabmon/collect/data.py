"""The data position: which batch comes next, and which batches must never be yielded.

Batches are numbered by a global index that counts every batch drawn from the loader since monitoring began,
across passes (epochs). Skipped indices (from a rollback) are drawn and dropped, never yielded, also after a
resume since the cursor is part of the monitor's state. On a fresh loader after a resume the cursor
fast-forwards to its position (``position % len(loader)`` batches into the pass when the loader has a length,
else ``position`` batches), which assumes the loader yields the same order again (a seeded sampler).

>>> cur = DataCursor()
>>> cur.skip_range(2, 3)
[2, 3, 4]
>>> [i for i, _ in cur.batches(range(8))]
[0, 1, 5, 6, 7]
>>> cur2 = DataCursor(); cur2.load_state_dict(cur.state_dict()); cur2.position, sorted(cur2.skip)
(8, [2, 3, 4])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class DataCursor:
    """Global batch index, skipped indices and rewinds; see the module docstring."""

    def __init__(self) -> None:
        self.position = 0
        self.skip: set[int] = set()
        self._rewind = False
        self.rewindable = True
        self.drawing = False  # the loop draws its batches through batches(): skips and rewinds take effect

    def skip_range(self, start: int, count: int) -> list[int]:
        indices = list(range(start, start + max(0, count)))
        self.skip.update(indices)
        return indices

    def rewind(self, position: int) -> None:
        """Continue from ``position`` (after a rollback); takes effect before the next batch is drawn."""
        self.position = position
        self._rewind = True

    def batches(self, loader: Iterable[Any], epochs: int | None = 1) -> Iterator[tuple[int, Any]]:
        """(global index, batch) for every batch not skipped, for ``epochs`` passes (None: forever)."""
        passes = 0
        first = True
        self.drawing = True
        while epochs is None or passes < epochs:
            it = iter(loader)
            self.rewindable = it is not loader
            offset = self._offset(loader) if (first or self._rewind) and self.rewindable else 0
            first, self._rewind = False, False
            drawn = self._fast_forward(it, offset)
            exhausted = False
            while not exhausted:
                if self._rewind and self.rewindable:
                    break
                try:
                    batch = next(it)
                except StopIteration:
                    exhausted = True
                    break
                drawn += 1
                index = self.position
                self.position += 1
                if index in self.skip:
                    continue
                yield index, batch
            if exhausted:
                if drawn == 0:
                    return  # an empty (or one-shot, used-up) loader would loop forever
                passes += 1

    def _offset(self, loader: Iterable[Any]) -> int:
        try:
            n = len(loader)  # type: ignore[arg-type]
        except TypeError:
            return self.position
        return self.position % n if n else 0

    @staticmethod
    def _fast_forward(it: Iterator[Any], count: int) -> int:
        drawn = 0
        for _ in range(count):
            try:
                next(it)
            except StopIteration:
                break
            drawn += 1
        return drawn

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "skip": sorted(self.skip)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position, skip = int(state["position"]), set(state.get("skip", []))
        self.position, self.skip, self._rewind = position, skip, True

    def snapshot(self) -> tuple[int, set[int], bool]:
        """Position, skip set and a rewind pending, as they are now (a failed load puts them back)."""
        return self.position, set(self.skip), self._rewind

    def restore(self, snapshot: tuple[int, set[int], bool]) -> None:
        position, skip, self._rewind = snapshot
        self.position, self.skip = position, set(skip)
