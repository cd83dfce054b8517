"""asyncio helpers shared by the services."""

import asyncio
import contextlib


async def cancel_and_wait(*tasks: "asyncio.Task[None] | None") -> None:
    """Cancel background tasks (None: nothing to do) and wait until each has finished."""
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task
