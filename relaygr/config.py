"""Builds a service's frozen dataclass config from defaults < TOML file < env vars < CLI flags."""

import argparse
import dataclasses
import enum
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from relaygr.bounds import POSITIVE, Bound
from relaygr.cli_help import default_note, with_notes
from relaygr.errors import ConfigError

T = TypeVar("T")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SCALARS: dict[Any, str] = {int: "int", float: "float", str: "str", Path: "path"}


class _BadValue(ValueError):
    """A raw value does not fit a field's type; the caller names the field and the source."""


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None` (or `Optional[X]`), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union) and len(args) == 2:
        inner = [a for a in args if a is not type(None)]
        return inner[0] if len(inner) == 1 else None
    return None


def _is_enum(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, enum.Enum)


def _tuple_element(tp: Any) -> Any | None:
    """X for `tuple[X, ...]`, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def _describe(tp: Any) -> str:
    """The valid values of a field type, for help texts and error messages."""
    if (inner := _optional_inner(tp)) is not None:
        return f"{_describe(inner)}, or empty for none"
    if (element := _tuple_element(tp)) is not None:
        return f"comma-separated list of {_describe(element)}"
    if _is_enum(tp):
        return "one of: " + ", ".join(str(member.value) for member in tp)
    if tp is bool:
        return "bool (true/false, yes/no, on/off, 1/0)"
    return _SCALARS[tp]


def _check_supported(tp: Any, name: str) -> None:
    inner = _optional_inner(tp)
    element = _tuple_element(tp)
    if inner is not None:
        _check_supported(inner, name)
    elif element is not None:
        if element not in _SCALARS:
            raise TypeError(f"config field {name}: tuple elements must be int, float, str or Path")
    elif not (tp is bool or tp in _SCALARS or _is_enum(tp)):
        raise TypeError(f"config field {name}: unsupported type {tp!r}")


def default_of(cls: type, name: str) -> Any:
    """The default of config dataclass `cls`'s field `name`: for tools that offer the field
    under their own flag without restating its default."""
    for f in dataclasses.fields(cls):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    raise KeyError(f"{cls.__name__} has no field {name!r} with a default")


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """The init fields of a flat config dataclass with their resolved types."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]
    for f, tp in fields:
        _check_supported(tp, f.name)
    return fields


def _convert(tp: Any, raw: Any, text: bool) -> Any:
    """`raw` as a value of `tp`: a string when `text` (env, flags), else a TOML value."""
    if (inner := _optional_inner(tp)) is not None:
        return None if raw == "" else _convert(inner, raw, text)
    if (element := _tuple_element(tp)) is not None:
        if isinstance(raw, str):
            parts = [part.strip() for part in raw.split(",")] if raw.strip() else []
            return tuple(_convert(element, part, True) for part in parts)
        if isinstance(raw, list) and not text:
            return tuple(_convert(element, item, False) for item in raw)
        raise _BadValue
    if _is_enum(tp):
        try:
            return tp(raw.strip() if isinstance(raw, str) else raw)
        except ValueError as err:
            raise _BadValue from err
    if isinstance(raw, bool):  # flags and TOML give real bools; a bool is never an int here
        if tp is bool:
            return raw
        raise _BadValue
    if tp is bool:
        word = raw.strip().lower() if text and isinstance(raw, str) else None
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise _BadValue
    if text:
        try:
            return raw if tp is str else tp(raw.strip())
        except ValueError as err:
            raise _BadValue from err
    if tp is float and isinstance(raw, int):
        return float(raw)
    if tp is Path and isinstance(raw, str):
        return Path(raw)
    if isinstance(raw, tp):
        return raw
    raise _BadValue


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _env_name(prefix: str, name: str) -> str:
    return f"{prefix}{name.upper()}"


def _metavar(tp: Any) -> str:
    if (inner := _optional_inner(tp)) is not None:
        return _metavar(inner)
    if (element := _tuple_element(tp)) is not None:
        return f"{_metavar(element)}[,...]"
    if _is_enum(tp):
        return "{" + ",".join(str(member.value) for member in tp) + "}"
    return _SCALARS.get(tp, "BOOL").upper()


def helped(text: str, bound: Bound | None = None) -> dict[str, Any]:
    """A config field's metadata: its `--help` text and, for a number, its valid range, which
    `check_bounds` enforces and `--help` states (`field(..., metadata=helped("...", POSITIVE))`).
    """
    return {"help": text, "bound": bound}


def check_bounds(config: object, what: str) -> None:
    """Raise ConfigError naming the first field of `config` (a dataclass) out of its bound."""
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        bound: Bound | None = f.metadata.get("bound")
        if bound is not None:
            bound.check(getattr(config, f.name), f"{what} {f.name}")


def add_config_arguments(
    parser: argparse.ArgumentParser, cls: type, *, env_prefix: str = ""
) -> None:
    """Add `--config FILE` and one flag per field of `cls`; every flag defaults to None (unset).

    The help of each flag gives the field's help metadata, its valid range, its default and,
    when `env_prefix` is given, the environment variable that sets it.
    """
    group = parser.add_argument_group(
        f"{cls.__name__} options", "precedence: flags > environment > --config file > defaults"
    )
    group.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML file of field = value (default: none)"
    )
    for f, tp in _fields(cls):
        if f.default is not dataclasses.MISSING:
            default = default_note(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = default_note(f.default_factory())
        else:
            default = "required"
        # The metavar or --x/--no-x shows the type; only "empty means none" needs saying.
        text = with_notes(
            f.metadata.get("help", ""),
            f.metadata.get("bound"),
            default,
            "empty for none" if _optional_inner(tp) is not None else "",
            f"env {_env_name(env_prefix, f.name)}" if env_prefix else "",
        )
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text.replace("%", "%%")}
        if tp is bool:
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            group.add_argument(_flag(f.name), metavar=_metavar(tp), **kwargs)


def _read_file(cls: type, path: Path, names: list[str]) -> dict[str, Any]:
    try:
        with path.open("rb") as stream:
            data = tomllib.load(stream)
    except OSError as err:
        raise ConfigError(f"cannot read {cls.__name__} config file {path}: {err}") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from err
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown keys {unknown} for {cls.__name__}; valid keys: {names}"
        )
    return data


def load_config(
    cls: type[T],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str = "",
    file: Path | None = None,
) -> T:
    """Build `cls` from its defaults, then `file` (or `args.config`), then `env`, then `args`.

    Each layer overrides only the fields it sets: a flag left at None, an absent env var and an
    absent file key leave the lower layer's value. Pass `os.environ` as `env` to read the process
    environment. Errors from `cls.__post_init__` pass through unchanged.
    """
    fields = _fields(cls)
    names = [f.name for f, _ in fields]
    flagged_file = getattr(args, "config", None) if args is not None else None
    path = Path(flagged_file) if flagged_file is not None else file
    # (raw values by field name, whether they are text, how to name their source), lowest first
    layers: list[tuple[dict[str, Any], bool, Callable[[str], str]]] = []
    if path is not None:
        data = _read_file(cls, path, names)
        layers.append((data, False, lambda _: f"file {path}"))
    if env is not None:
        found = {n: env[_env_name(env_prefix, n)] for n in names if _env_name(env_prefix, n) in env}
        layers.append((found, True, lambda n: f"env {_env_name(env_prefix, n)}"))
    if args is not None:
        given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        layers.append((given, True, lambda n: f"flag {_flag(n)}"))
    values: dict[str, Any] = {}
    for raw_values, text, source in layers:
        for f, tp in fields:
            if f.name not in raw_values:
                continue
            raw = raw_values[f.name]
            try:
                values[f.name] = _convert(tp, raw, text)
            except _BadValue as err:
                raise ConfigError(
                    f"{cls.__name__}.{f.name}: invalid value {raw!r} from {source(f.name)};"
                    f" expected {_describe(tp)}"
                ) from err
    for f, _ in fields:
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in values:
            raise ConfigError(
                f"{cls.__name__}.{f.name} is required: set it in the config file,"
                f" env {_env_name(env_prefix, f.name)} or flag {_flag(f.name)}"
            )
    return cls(**values)


def require_positive(config: object, names: Sequence[str], what: str) -> None:
    """Raise ConfigError naming the first of `names` whose value on `config` is not > 0 (for
    configs that are not flags; a flag's field states its bound in `helped`)."""
    for name in names:
        POSITIVE.check(getattr(config, name), f"{what} {name}")


def override_config(base: T, data: Mapping[str, Any], allowed: Sequence[str], source: str) -> T:
    """`base` with the fields in `data` (JSON/TOML values) replaced, validated like the rest.

    Only fields named in `allowed` may change; an unknown or disallowed key, a value of the
    wrong type, or one that `__post_init__` refuses raises ConfigError naming it and `source`.
    """
    fields = dict((f.name, tp) for f, tp in _fields(type(base)))
    bad = sorted(k for k in data if k not in allowed or k not in fields)
    if bad:
        raise ConfigError(f"{source}: keys {bad} cannot be set here; allowed: {list(allowed)}")
    values: dict[str, Any] = {}
    for name, raw in data.items():
        try:
            values[name] = _convert(fields[name], raw, False)
        except _BadValue as err:
            raise ConfigError(
                f"{source}: {name}: invalid value {raw!r}; expected {_describe(fields[name])}"
            ) from err
    try:
        return dataclasses.replace(base, **values)  # type: ignore[type-var]
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from err
