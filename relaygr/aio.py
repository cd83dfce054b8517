"""asyncio helpers shared by the services."""

import asyncio


async def cancel_and_wait(*tasks: "asyncio.Task[None] | None") -> None:
    """Cancel background tasks (None: nothing to do) and wait until each has finished.

    A task's own cancellation ends quietly; a cancellation of the caller requested while it
    waits propagates, as from any await (the tasks are cancelled by then, perhaps not yet
    finished).
    """
    running = [task for task in tasks if task is not None]
    # Requests the caller had before: one swallowed earlier (never uncancelled) must not make a
    # task's own cancellation look like the caller's.
    before = cancellation_requests()
    for task in running:
        task.cancel()
    for task in running:
        try:
            await task
        except asyncio.CancelledError:
            if cancellation_requests() > before:
                raise


def cancellation_requests() -> int:
    """Cancellations requested of the running task and not withdrawn (0 outside a task): more
    than before an await means the CancelledError it raised is the task's own, not one that
    a library raised for something it cancelled under it (a gRPC call, say)."""
    current = asyncio.current_task()
    return current.cancelling() if current is not None else 0
