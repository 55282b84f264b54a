"""Which rank came last to a collective: each rank's arrival travels, as one integer,
in the element-wise maximum that `EqualLengthIterator` computes anyway on every step."""

from __future__ import annotations

import time

from .._core.probe import StageProbe

RANK_BITS = 20
"""Low bits of an arrival code that hold the rank (up to about a million ranks)."""

_MAX_GAP_US = (1 << (63 - RANK_BITS)) - 1


class Arrivals:
    """One rank's arrival times at successive collectives."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.left = time.perf_counter()

    def code(self) -> int:
        """This rank's arrival: the microseconds since it left the previous collective
        (its step and its data), above its rank; the maximum over ranks names the last
        one to arrive, the one the others wait for."""
        gap = int((time.perf_counter() - self.left) * 1e6)
        return min(gap, _MAX_GAP_US) << RANK_BITS | self.rank

    def left_collective(self, entered: float, last: int, probe: StageProbe | None) -> None:
        """The collective entered at `entered` returned `last` (the maximum of the
        codes): with statistics on, its time counts as waiting for that rank."""
        self.left = time.perf_counter()
        if probe is not None:
            probe.waited(self.left - entered, last & ((1 << RANK_BITS) - 1))
