"""Valid ranges of numeric options: one object checks a value and words its range, so an
option's `--help` and its error say the same thing."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Generic, TypeVar

from relaygr.errors import ConfigError

N = TypeVar("N", int, float)


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True, slots=True)
class Bound:
    """`low` < or <= value < or <= `high` (None: unbounded on that side); `meaning` says what a
    special value stands for (e.g. "0: off")."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    meaning: str = ""

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    @property
    def range(self) -> str:
        """The range alone: "> 0", ">= 1", "in (0, 1]", "in [0, 65535]"."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return "any number"

    @property
    def help(self) -> str:
        """How `--help` states it: the range, then what a special value means."""
        return f"{self.range}, {self.meaning}" if self.meaning else self.range

    def refusal(self, value: object) -> str:
        """Why `value` is refused: "must be >= 0 (0: auto), got -1"."""
        meaning = f" ({self.meaning})" if self.meaning else ""
        return f"must be {self.range}{meaning}, got {value}"

    def check(self, value: float, name: str) -> None:
        """Raise ConfigError naming `name` (e.g. "ranker threads") unless `value` is in range."""
        if value not in self:
            raise ConfigError(f"{name} {self.refusal(value)}")


POSITIVE = Bound(low=0, low_open=True)
NON_NEGATIVE = Bound(low=0)
AT_LEAST_ONE = Bound(low=1)
SHARE = Bound(low=0, high=1, low_open=True)  # a fraction of something, (0, 1]


def non_negative(meaning: str) -> Bound:
    """>= 0, where 0 means `meaning` (e.g. "0: never")."""
    return Bound(low=0, meaning=meaning)


@dataclass(frozen=True, slots=True)
class Bounded(Generic[N]):
    """An argparse `type` that parses a number and refuses one out of `bound`; the shared help
    formatter (`relaygr.cli_help`) states the bound from here."""

    kind: type[N]
    bound: Bound

    def __call__(self, text: str) -> N:
        try:
            value = self.kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from err
        if value not in self.bound:
            raise argparse.ArgumentTypeError(self.bound.refusal(value))
        return value
