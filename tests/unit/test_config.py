"""The typed-config loader: layer precedence, parsing per type, error messages and --help."""

import argparse
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest

from relaygr.bounds import POSITIVE, SHARE, Bound, Bounded, non_negative
from relaygr.cli_help import HelpFormatter
from relaygr.config import add_config_arguments, check_bounds, helped, load_config
from relaygr.errors import ConfigError

PREFIX = "T_"


class Mode(StrEnum):
    FAST = "fast"
    SAFE = "safe"


@dataclass(frozen=True, slots=True)
class Sample:
    listen: str = field(default="127.0.0.1:0", metadata={"help": "address to bind"})
    workers: int = field(default=2, metadata={"help": "worker threads"})
    ratio: float = field(default=0.5, metadata={"help": "share of 100% kept"})
    verbose: bool = field(default=False, metadata={"help": "log every request"})
    mode: Mode = field(default=Mode.FAST, metadata={"help": "scheduling mode"})
    ports: tuple[int, ...] = field(default=(1, 2), metadata={"help": "ports to probe"})
    tags: tuple[str, ...] = field(default=(), metadata={"help": "labels"})
    limit: int | None = field(default=None, metadata={"help": "request cap"})
    root: Path = field(default=Path("/tmp/x"), metadata={"help": "data directory"})

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")


@dataclass(frozen=True, slots=True)
class Required:
    name: str
    size: int = 1


def _parser(cls: type = Sample) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="svc")
    add_config_arguments(parser, cls, env_prefix=PREFIX)
    return parser


def _load(
    tmp_path: Path,
    toml: str | None = None,
    env: dict[str, str] | None = None,
    argv: list[str] | None = None,
    cls: type = Sample,
) -> Any:
    file = None
    if toml is not None:
        file = tmp_path / "svc.toml"
        file.write_text(toml)
    args = _parser(cls).parse_args(argv or [])
    return load_config(cls, args, env or {}, PREFIX, file)


@pytest.mark.parametrize(
    ("toml", "env", "argv", "changed"),
    [
        (None, {}, [], {}),
        ("workers = 3", {}, [], {"workers": 3}),
        ("workers = 3\nratio = 0.25", {"T_WORKERS": "4"}, [], {"workers": 4, "ratio": 0.25}),
        ("workers = 3", {"T_WORKERS": "4"}, ["--workers", "5"], {"workers": 5}),
        (
            'workers = 3\nlisten = "file:1"',
            {"T_RATIO": "0.75", "T_LISTEN": "env:1"},
            ["--listen", "flag:1"],
            {"workers": 3, "ratio": 0.75, "listen": "flag:1"},
        ),
        (None, {"T_MODE": "safe"}, ["--ports", "9"], {"mode": Mode.SAFE, "ports": (9,)}),
        (None, {"OTHER_WORKERS": "9", "WORKERS": "9"}, [], {}),  # other prefixes are ignored
    ],
)
def test_each_layer_overrides_only_what_it_sets(
    tmp_path: Path, toml: str | None, env: dict[str, str], argv: list[str], changed: dict
) -> None:
    assert _load(tmp_path, toml, env, argv) == replace(Sample(), **changed)


def test_config_flag_names_the_file_and_overrides_the_file_argument(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text("workers = 3")
    (tmp_path / "b.toml").write_text("workers = 4")
    args = _parser().parse_args(["--config", str(tmp_path / "b.toml")])
    assert load_config(Sample, args, file=tmp_path / "a.toml").workers == 4
    assert load_config(Sample, file=tmp_path / "a.toml").workers == 3


def test_no_layers_gives_the_defaults() -> None:
    assert load_config(Sample) == Sample()


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("listen", " spaced ", " spaced "),
        ("workers", "7", 7),
        ("workers", " 8 ", 8),
        ("ratio", "1e-3", 0.001),
        ("mode", "safe", Mode.SAFE),
        ("ports", "3, 4,5", (3, 4, 5)),
        ("ports", "", ()),
        ("tags", "a,b", ("a", "b")),
        ("limit", "9", 9),
        ("limit", "", None),
        ("root", "/data", Path("/data")),
        ("verbose", "yes", True),
        ("verbose", "ON", True),
        ("verbose", "1", True),
        ("verbose", "false", False),
        ("verbose", "off", False),
    ],
)
def test_text_values_parse_the_same_from_env_and_flags(
    tmp_path: Path, name: str, text: str, expected: object
) -> None:
    env = {f"T_{name.upper()}": text}
    assert getattr(_load(tmp_path, env=env), name) == expected
    if name != "verbose":  # a bool flag takes no value: see the next test
        assert getattr(_load(tmp_path, argv=[f"--{name}", text]), name) == expected


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], False),
        ({}, ["--verbose"], True),
        ({"T_VERBOSE": "true"}, [], True),
        ({"T_VERBOSE": "true"}, ["--no-verbose"], False),
        ({"T_VERBOSE": "false"}, ["--verbose"], True),
    ],
)
def test_bool_flags(tmp_path: Path, env: dict[str, str], argv: list[str], expected: bool) -> None:
    assert _load(tmp_path, env=env, argv=argv).verbose is expected


def test_file_values_use_toml_types(tmp_path: Path) -> None:
    toml = """
        listen = "h:1"
        workers = 6
        ratio = 1
        verbose = true
        mode = "safe"
        ports = [7, 8]
        tags = "x, y"
        limit = ""
        root = "/srv"
    """
    expected = Sample("h:1", 6, 1.0, True, Mode.SAFE, (7, 8), ("x", "y"), None, Path("/srv"))
    assert _load(tmp_path, toml) == expected


def test_flags_default_to_none_so_unset_flags_do_not_override() -> None:
    args = vars(_parser().parse_args([]))
    assert args == dict.fromkeys([*Sample.__dataclass_fields__, "config"])


@pytest.mark.parametrize(
    ("toml", "env", "argv", "expected"),
    [
        (None, {"T_WORKERS": "many"}, [], "Sample.workers: invalid value 'many' from env T_WORKERS;"
         " expected int"),
        (None, {}, ["--mode", "turbo"], "Sample.mode: invalid value 'turbo' from flag --mode;"
         " expected one of: fast, safe"),
        (None, {"T_VERBOSE": "maybe"}, [], "Sample.verbose: invalid value 'maybe' from env"
         " T_VERBOSE; expected bool (true/false, yes/no, on/off, 1/0)"),
        (None, {}, ["--ports", "1,x"], "Sample.ports: invalid value '1,x' from flag --ports;"
         " expected comma-separated list of int"),
        (None, {}, ["--limit", "none"], "Sample.limit: invalid value 'none' from flag --limit;"
         " expected int, or empty for none"),
        (None, {}, ["--ratio", "half"], "Sample.ratio: invalid value 'half' from flag --ratio;"
         " expected float"),
        ('ratio = "x"', {}, [], "Sample.ratio: invalid value 'x' from file {file}; expected float"),
        ("workers = true", {}, [], "Sample.workers: invalid value True from file {file};"
         " expected int"),
        ("workers = 1.5", {}, [], "Sample.workers: invalid value 1.5 from file {file};"
         " expected int"),
        ('verbose = "yes"', {}, [], "Sample.verbose: invalid value 'yes' from file {file};"
         " expected bool (true/false, yes/no, on/off, 1/0)"),
        ("ports = [1, true]", {}, [], "Sample.ports: invalid value [1, True] from file {file};"
         " expected comma-separated list of int"),
    ],
)  # fmt: skip
def test_bad_values_name_field_source_value_and_valid_values(
    tmp_path: Path, toml: str | None, env: dict[str, str], argv: list[str], expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, toml, env, argv)
    assert str(caught.value) == expected.format(file=tmp_path / "svc.toml")


def test_unknown_file_key_names_the_valid_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, "wrokers = 3\n[model]\nx = 1")
    assert str(caught.value) == (
        f"config file {tmp_path / 'svc.toml'}: unknown keys ['model', 'wrokers'] for Sample;"
        " valid keys: ['listen', 'workers', 'ratio', 'verbose', 'mode', 'ports', 'tags', 'limit',"
        " 'root']"
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [(None, "cannot read Sample config file"), ("workers = ", "is not valid TOML")],
)
def test_unreadable_or_malformed_file(tmp_path: Path, content: str | None, expected: str) -> None:
    path = tmp_path / "bad.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=expected) as caught:
        load_config(Sample, file=path)
    assert str(path) in str(caught.value)


def test_post_init_errors_pass_through_unchanged(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, env={"T_WORKERS": "0"})
    assert caught.value.args == ("workers must be >= 1, got 0",)


def test_required_fields_must_be_set_by_some_layer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, cls=Required)
    assert str(caught.value) == (
        "Required.name is required: set it in the config file, env T_NAME or flag --name"
    )
    assert _load(tmp_path, env={"T_NAME": "n"}, cls=Required) == Required("n")


@pytest.mark.parametrize(
    "line",
    [
        "--config FILE",
        "--listen STR",
        "address to bind (default: 127.0.0.1:0; env T_LISTEN)",
        "--workers INT",
        "worker threads (default: 2; env T_WORKERS)",
        "--ratio FLOAT",
        "share of 100% kept (default: 0.5; env T_RATIO)",
        "--verbose, --no-verbose",
        "log every request (default: false; env T_VERBOSE)",
        "--mode {fast,safe}",
        "scheduling mode (default: fast; env T_MODE)",
        "--ports INT[,...]",
        "ports to probe (default: 1,2; env T_PORTS)",
        "--tags STR[,...]",
        "labels (default: empty; env T_TAGS)",
        "--limit INT",
        "request cap (default: none; empty for none; env T_LIMIT)",
        "--root PATH",
        "data directory (default: /tmp/x; env T_ROOT)",
    ],
)
def test_help_documents_every_option_and_its_default(line: str) -> None:
    # Join argparse's wrapped lines so each option's help reads as one line.
    help_text = " ".join(_parser().format_help().split())
    assert line in help_text


def test_help_without_env_prefix_omits_env_names() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Sample)
    assert "(default: 2)" in " ".join(parser.format_help().split())


def test_unsupported_types_are_programming_errors() -> None:
    @dataclass(frozen=True)
    class Nested:
        inner: dict[str, int] = field(default_factory=dict)

    with pytest.raises(TypeError, match="inner: unsupported type"):
        load_config(Nested)
    with pytest.raises(TypeError, match="is not a dataclass"):
        add_config_arguments(argparse.ArgumentParser(), int)


@dataclass(frozen=True, slots=True)
class Ranged:
    rate: float = field(default=1.0, metadata=helped("requests per second", POSITIVE))
    hedge_ms: int = field(default=0, metadata=helped("hedge delay", non_negative("0: never")))
    share: float = field(default=0.5, metadata=helped("share kept", SHARE))
    port: int = field(default=0, metadata=helped("port", Bound(low=0, high=65535)))

    def __post_init__(self) -> None:
        check_bounds(self, "svc")


@pytest.mark.parametrize(
    ("flag", "value", "help_says", "error"),
    [
        ("--rate", "0", "(> 0; default: 1.0;", "svc rate must be > 0, got 0.0"),
        ("--hedge-ms", "-1", "(>= 0, 0: never; default: 0;", "must be >= 0 (0: never), got -1"),
        ("--share", "1.5", "(in (0, 1]; default: 0.5;", "svc share must be in (0, 1], got 1.5"),
        ("--port", "65536", "(in [0, 65535]; default: 0;", "must be in [0, 65535], got 65536"),
    ],
)
def test_a_fields_bound_is_checked_and_stated_in_its_help_alike(
    flag: str, value: str, help_says: str, error: str
) -> None:
    parser = _parser(Ranged)
    assert help_says in " ".join(parser.format_help().split())
    with pytest.raises(ConfigError) as refused:
        load_config(Ranged, parser.parse_args([flag, value]))
    assert error in str(refused.value)
    edge = {"--rate": "1e-9", "--hedge-ms": "0", "--share": "1", "--port": "65535"}[flag]
    load_config(Ranged, parser.parse_args([flag, edge]))  # the range's edge is in it


def test_the_shared_formatter_states_a_bounded_options_range_and_any_default() -> None:
    parser = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    parser.add_argument("--count", type=Bounded(int, POSITIVE), default=3, help="how many")
    parser.add_argument("--name", default="a%b", help="what")
    parser.add_argument("--seed", type=int, help="seed (default: random)")
    parser.add_argument("--fast", action="store_true", help="hurry")
    text = " ".join(parser.format_help().split())
    assert "how many (> 0; default: 3)" in text
    assert "what (default: a%b)" in text
    assert "seed (default: random)" in text
    assert "hurry (default: false)" in text
    with pytest.raises(SystemExit):
        parser.parse_args(["--count", "0"])
    assert parser.parse_args(["--count", "2"]).count == 2
