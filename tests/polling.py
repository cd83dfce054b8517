"""Waiting for a condition with a deadline: the one way tests synchronise, never a bare sleep."""

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], what: str = "condition", timeout_s: float = 10.0
) -> None:
    """Re-evaluate `check` (sync or async) until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.01)
