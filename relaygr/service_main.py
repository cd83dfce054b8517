"""The one `main` every service shares: typed config from file/env/flags, logging, asyncio run."""

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from relaygr.config import add_config_arguments, load_config
from relaygr.errors import ConfigError

T = TypeVar("T")


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
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser, config_cls, env_prefix=env_prefix)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(config_cls, args, os.environ, env_prefix)
    except ConfigError as err:
        parser.error(str(err))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(cfg))
    except ConfigError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    return 0
