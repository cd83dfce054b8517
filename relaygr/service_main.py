"""The one `main` every service shares: typed config from file/env/flags, logging, asyncio run."""

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from relaygr.authz import authz_help
from relaygr.cli_help import HelpFormatter
from relaygr.config import add_config_arguments, load_config
from relaygr.errors import ConfigError
from relaygr.logs import configure_logging


class LoggingOptions(Protocol):
    """What every service config says about its logs (validated by the config)."""

    @property
    def log_level(self) -> str: ...

    @property
    def log_format(self) -> str: ...


T = TypeVar("T", bound=LoggingOptions)


def service_main(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    config_cls: type[T],
    env_prefix: str,
    serve: Callable[[T], Coroutine[Any, Any, None]],
) -> int:
    """Parse `config_cls` (a bad value exits 2 naming it), then run `serve(config)` to the end."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=HelpFormatter, epilog=authz_help()
    )
    add_config_arguments(parser, config_cls, env_prefix=env_prefix)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(config_cls, args, os.environ, env_prefix)
    except ConfigError as err:
        parser.error(str(err))
    configure_logging(cfg.log_level, cfg.log_format, prog.removeprefix("relaygr "))
    try:
        asyncio.run(serve(cfg))
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    return 0
