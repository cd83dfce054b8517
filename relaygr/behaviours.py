"""Domain inputs every service shares: columnar behaviours, the prefix [U, S_l], a rank input."""

from dataclasses import dataclass
from typing import NewType

import numpy as np
import numpy.typing as npt

from relaygr.errors import InvalidInput

UserId = NewType("UserId", str)
Int64Array = npt.NDArray[np.int64]

_EMPTY = np.zeros(0, dtype=np.int64)


def as_int64(values: object, what: str) -> Int64Array:
    """Convert a sequence of integers to a 1-D int64 array, naming `what` on failure."""
    try:
        array = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidInput(f"{what} must be integers: {err}") from err
    if array.ndim != 1:
        raise InvalidInput(f"{what} must be one-dimensional, got shape {array.shape}")
    return array


def _check_non_decreasing(timestamps: Int64Array, what: str) -> None:
    """Raise InvalidInput naming the first entry of `timestamps` (an array named `what`, e.g.
    "long_term.timestamps") that is smaller than the entry before it."""
    drops = np.flatnonzero(timestamps[1:] < timestamps[:-1])
    if len(drops) == 0:
        return
    i, column = int(drops[0]) + 1, what.rsplit(".", 1)[-1]
    raise InvalidInput(
        f"{what}[{i}] = {timestamps[i]} is before {column}[{i - 1}] = {timestamps[i - 1]};"
        " behaviour timestamps must be non-decreasing"
    )


@dataclass(frozen=True, slots=True)
class Behaviours:
    """A behaviour sequence as parallel int64 columns; entry i of each column is behaviour i.

    The columns always have equal lengths. `of` builds one from outside input and also holds it
    to the contract's order: timestamps non-decreasing.
    """

    item_ids: Int64Array
    actions: Int64Array
    timestamps: Int64Array

    def __post_init__(self) -> None:
        lengths = (len(self.item_ids), len(self.actions), len(self.timestamps))
        if len(set(lengths)) != 1:
            items, actions, timestamps = lengths
            raise InvalidInput(
                f"ragged behaviour arrays: item_ids has {items} entries, actions {actions}, "
                f"timestamps {timestamps}"
            )

    @classmethod
    def of(
        cls, item_ids: object, actions: object, timestamps: object, what: str = ""
    ) -> "Behaviours":
        """Behaviours from outside input (a request, a trace); InvalidInput, naming the sequence
        `what` ("long_term", "short_term"), unless its columns are one-dimensional integer
        arrays of equal lengths with non-decreasing timestamps."""
        name = f"{what}." if what else ""
        behaviours = cls(
            as_int64(item_ids, f"{name}item_ids"),
            as_int64(actions, f"{name}actions"),
            as_int64(timestamps, f"{name}timestamps"),
        )
        _check_non_decreasing(behaviours.timestamps, f"{name}timestamps")
        return behaviours

    @classmethod
    def empty(cls) -> "Behaviours":
        return cls(_EMPTY, _EMPTY, _EMPTY)

    def __len__(self) -> int:
        return len(self.item_ids)

    def slice(self, start: int, stop: int | None = None) -> "Behaviours":
        return Behaviours(
            self.item_ids[start:stop], self.actions[start:stop], self.timestamps[start:stop]
        )

    def concat(self, other: "Behaviours") -> "Behaviours":
        return Behaviours(
            np.concatenate([self.item_ids, other.item_ids]),
            np.concatenate([self.actions, other.actions]),
            np.concatenate([self.timestamps, other.timestamps]),
        )

    def records(self) -> Int64Array:
        """Row-major [n, 3] records (item, action, ts): the byte stream the prefix digest reads."""
        return np.stack([self.item_ids, self.actions, self.timestamps], axis=1)


@dataclass(frozen=True, slots=True)
class Prefix:
    """The candidate-independent part of a ranking input: [U, S_l]."""

    user_id: UserId
    user_features: Int64Array
    long_term: Behaviours

    @property
    def num_tokens(self) -> int:
        return len(self.user_features) + len(self.long_term)


@dataclass(frozen=True, slots=True)
class RankInput:
    """A full ranking input [U, S_l | S_s | I]; candidates are scored at `request_ts`."""

    prefix: Prefix
    short_term: Behaviours
    candidates: Int64Array
    request_ts: int

    @property
    def history_tokens(self) -> int:
        return self.prefix.num_tokens + len(self.short_term)
