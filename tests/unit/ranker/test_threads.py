"""The ranker's `threads` option: how it is set, validated, documented and resolved."""

import argparse

import pytest

from relaygr.config import add_config_arguments, load_config
from relaygr.errors import ConfigError
from services.ranker.config import ENV_PREFIX, RankerConfig
from services.ranker.server import intra_op_threads


def config(**fields: int) -> RankerConfig:
    return RankerConfig(plaintext=True, **fields)


def _parsed(argv: list[str], env: dict[str, str]) -> RankerConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RankerConfig, env_prefix=ENV_PREFIX)
    return load_config(RankerConfig, parser.parse_args([*argv, "--plaintext"]), env, ENV_PREFIX)


def test_default_is_auto() -> None:
    assert config().threads == 0


def test_set_by_env_and_overridden_by_flag() -> None:
    env = {"RELAYGR_RANKER_THREADS": "3"}
    assert _parsed([], env).threads == 3
    assert _parsed(["--threads", "1"], env).threads == 1


def test_negative_is_refused_naming_the_range() -> None:
    with pytest.raises(ConfigError, match=r"ranker threads must be >= 0 \(0: auto\), got -1"):
        config(threads=-1)


def test_help_states_default_range_and_env() -> None:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, RankerConfig, env_prefix=ENV_PREFIX)
    text = " ".join(parser.format_help().split())
    assert "--threads INT torch intra-op compute threads; auto: the process's CPU quota" in text
    assert "at least 1) (>= 0, 0: auto; default: 0; env RELAYGR_RANKER_THREADS)" in text


def test_auto_takes_the_cpu_quota_and_a_set_value_wins() -> None:
    assert intra_op_threads(config(), cpus=lambda: 3) == 3
    assert intra_op_threads(config(threads=5), cpus=lambda: 3) == 5
