"""The relays the trigger has been asked for, by size: what a byte of relay room costs.

Pure: no I/O, time passed in as `now` (seconds of one clock, any origin).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Size classes: a relay's KV bytes, in steps of 2^(1/4) (about 19%).
CLASSES_PER_DOUBLING = 4
# Rates are read over at least this span: the first relays seen are not read as a flood.
MIN_SPAN_S = 1.0
# Past this many half-lives since the reference, the scaled sums are brought back to now.
RESCALE_HALF_LIVES = 64.0


def size_class(nbytes: int) -> int:
    """The size class of a relay of `nbytes`: classes grow with size (an empty relay is in
    the first)."""
    return math.floor(math.log2(max(nbytes, 1)) * CLASSES_PER_DOUBLING)


@dataclass(slots=True)
class RelayDemand:
    """Relays asked for lately, as bytes per second in each size class.

    Each class keeps the bytes asked for, decaying by half every `half_life_s`, divided by the
    decayed time observed (at least `MIN_SPAN_S`): a steady flow reads as its rate from the
    first seconds on, and a flow that changes is followed within a few half-lives.

    `held_below(nbytes, hold_s, now)` is Little's law over the smaller classes: the bytes that
    relays of a smaller size class than `nbytes` would hold at once if every one were admitted
    and held its bytes `hold_s`; `held_above` the same over the larger classes.
    """

    half_life_s: float = 10.0
    # class -> bytes asked for, each scaled by 2^((asked at - ref) / half_life_s)
    _scaled: dict[int, float] = field(default_factory=dict)
    _ref: float = 0.0
    _since: float | None = None  # when the first relay was asked for

    def add(self, nbytes: int, now: float) -> None:
        if self._since is None:
            self._since = self._ref = now
        elif (now - self._ref) / self.half_life_s > RESCALE_HALF_LIVES:
            keep = math.exp2(-(now - self._ref) / self.half_life_s)
            self._scaled = {k: v * keep for k, v in self._scaled.items() if v * keep > 1e-300}
            self._ref = now
        cls = size_class(nbytes)
        weight = math.exp2((now - self._ref) / self.half_life_s)
        self._scaled[cls] = self._scaled.get(cls, 0.0) + nbytes * weight

    def rate_below(self, nbytes: int, now: float) -> float:
        """Bytes per second asked for in relays of a smaller size class than `nbytes`."""
        below = size_class(nbytes)
        return self._rate(lambda cls: cls < below, now)

    def rate_above(self, nbytes: int, now: float) -> float:
        """Bytes per second asked for in relays of a larger size class than `nbytes`."""
        above = size_class(nbytes)
        return self._rate(lambda cls: cls > above, now)

    def _rate(self, counted: Callable[[int], bool], now: float) -> float:
        if self._since is None:
            return 0.0
        scaled = sum(v for k, v in self._scaled.items() if counted(k))
        if not scaled:
            return 0.0
        h = self.half_life_s
        span = max(now - self._since, MIN_SPAN_S)
        observed = h / math.log(2) * -math.expm1(-span * math.log(2) / h)
        return scaled * math.exp2(-(now - self._ref) / h) / observed

    def held_below(self, nbytes: int, hold_s: float, now: float) -> float:
        return self.rate_below(nbytes, now) * hold_s

    def held_above(self, nbytes: int, hold_s: float, now: float) -> float:
        return self.rate_above(nbytes, now) * hold_s
