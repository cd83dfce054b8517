"""asyncio helpers shared by the services."""

import asyncio


async def cancel_and_wait(*tasks: "asyncio.Task[None] | None") -> None:
    """Cancel background tasks (None: nothing to do) and wait until each has finished.

    A task's own cancellation ends quietly; a cancellation of the caller while it waits
    propagates, as from any await (the tasks are cancelled by then, perhaps not yet finished).
    """
    running = [task for task in tasks if task is not None]
    for task in running:
        task.cancel()
    for task in running:
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
