"""cancel_and_wait: background tasks end quietly, and the caller's own cancellation is kept."""

import asyncio
import contextlib

import pytest

from relaygr.aio import cancel_and_wait


async def test_tasks_are_cancelled_and_awaited_quietly() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    tasks = [asyncio.create_task(forever()) for _ in range(2)]
    await started.wait()
    await cancel_and_wait(*tasks, None)
    assert all(t.cancelled() for t in tasks)


async def test_a_cancelled_caller_is_not_swallowed() -> None:
    # A background task that takes its time to wind down (its clean-up awaits), and a caller
    # cancelled while it waits for it: the caller ends cancelled, not returned normally.
    started, winding, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow_to_stop() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            winding.set()
            await release.wait()

    task = asyncio.create_task(slow_to_stop())
    await started.wait()
    caller = asyncio.create_task(cancel_and_wait(task))
    await winding.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert caller.cancelled()
    release.set()
    await asyncio.wait([task])
    assert task.cancelled()


async def test_a_cancellation_the_caller_swallowed_earlier_does_not_leak_into_the_wait() -> None:
    # The caller once caught a cancellation without uncancelling (its count stays 1); a later
    # cancel_and_wait of its own tasks still ends quietly.
    started = asyncio.Event()

    async def caller() -> None:
        current = asyncio.current_task()
        assert current is not None
        current.cancel()
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as careless code does
            await asyncio.Event().wait()
        task = asyncio.create_task(forever(started))
        await started.wait()
        await cancel_and_wait(task)
        assert task.cancelled()

    await asyncio.create_task(caller())


async def forever(started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()
