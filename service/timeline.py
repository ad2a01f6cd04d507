"""What the forecast (service/forecast.py) plans each resource with: how much of it is held over
time, and the first moment from which a job's need fits for its whole length."""

from __future__ import annotations

import bisect
import math


class Timeline:
    """What is held of one thing over time (a GPU's memory, a user's GPUs under their limit, a
    node's cores), a step function: ``held[i]`` from ``times[i]`` until the next moment (the last
    until for ever); a whole-GPU job holds inf of its GPU."""

    def __init__(self, room: float) -> None:
        self.room = room  # what may be held at once: a GPU's memory less foreign processes', a user's limit
        self.times: list[float] = [-math.inf]
        self.held: list[float] = [0.0]

    def fits(self, held: float, need: float | None) -> bool:
        """Whether a job needing ``need`` MiB (None: the whole GPU) fits beside ``held``."""
        return held == 0 if need is None else held + need <= self.room

    def _at(self, t: float) -> int:
        """The index of the step starting at ``t``, made where none did."""
        i = bisect.bisect_left(self.times, t)
        if i == len(self.times) or self.times[i] != t:
            self.times.insert(i, t)
            self.held.insert(i, self.held[i - 1])
        return i

    def hold(self, start: float, end: float, mib: float) -> None:
        first = self._at(start)
        last = len(self.times) if math.isinf(end) else self._at(end)
        for i in range(first, last):
            self.held[i] += mib

    def next_free(self, t: float, length: float, need: float | None, past: float) -> float:
        """The first moment from ``t`` from which a job needing ``need`` fits for ``length`` seconds
        (inf: never, or not before ``past``, where the caller stops looking). Walks the steps from
        ``t``'s: one the job does not fit beside moves its start to that step's end."""
        i = bisect.bisect_right(self.times, t) - 1
        start = t
        while True:
            if start > past:
                return math.inf
            ends = self.times[i + 1] if i + 1 < len(self.times) else math.inf
            if not self.fits(self.held[i], need):
                if math.isinf(ends):
                    return math.inf
                start = ends
            elif ends >= start + length:
                return start
            i += 1
