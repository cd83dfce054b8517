"""A stored JSON object (etcd records, live config), parsed with an error that names its source."""

import json
from typing import Any

from relaygr.errors import RelayGRError


def json_object(raw: bytes, source: str, error: type[RelayGRError]) -> dict[str, Any]:
    """`raw` parsed as a JSON object; else `error` saying, after `source`, what is wrong."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{source}: not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise error(f"{source}: expected a JSON object, got {type(data).__name__}")
    return data
