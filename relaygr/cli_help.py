"""How every `relaygr` command words an option in `--help`: its text, then its valid range and
its default in parentheses, for the services' config flags and the other commands' alike."""

import argparse
import enum
from typing import Any

from relaygr.bounds import Bound, Bounded


def show(value: Any) -> str:
    """A value as a user would type it."""
    if value is None:
        return "none"
    if isinstance(value, tuple | list):
        return ",".join(show(item) for item in value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def default_note(value: Any) -> str:
    return f"default: {show(value) or 'empty'}"


def with_notes(text: str, bound: Bound | None, *notes: str) -> str:
    """`text (range; note; ...)`: the bound's range first, empty notes left out."""
    kept = [note for note in (bound.help if bound else "", *notes) if note]
    return f"{text} ({'; '.join(kept)})".strip() if kept else text


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Ends each option's help with its valid range (from a `Bounded` type) and its default.

    An option whose help already names its default keeps that wording; one defaulting to None
    must say in its help what leaving it out means, and one without help shows nothing (argparse
    prints no help line for it). Descriptions keep their line breaks.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS:
            return text
        bound = action.type.bound if isinstance(action.type, Bounded) else None
        named = "default" in text or action.default is None
        notes = with_notes("", bound, "" if named else default_note(action.default))
        # The notes are literal text, and argparse %-formats what this returns.
        return f"{text} {notes.replace('%', '%%')}".strip()
