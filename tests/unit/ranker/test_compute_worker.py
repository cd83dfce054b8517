"""The service's compute thread: runs calls in order, and outlives an event loop that closed
before a result came back."""

import asyncio
import threading

from services.ranker.compute_worker import ComputeWorker


def test_a_result_for_a_closed_loop_does_not_end_the_worker() -> None:
    worker = ComputeWorker()
    closed = asyncio.new_event_loop()
    closed.close()
    worker.run(lambda: (1, 0.0), lambda *_: closed.call_soon_threadsafe(print))
    got: list[object] = []
    done = threading.Event()
    worker.run(lambda: ("next", 0.5), lambda r, e, s: (got.append((r, e, s)), done.set()))
    assert done.wait(10), "the worker ran the next call"
    assert got == [("next", None, 0.5)] and worker.idle
    worker.stop()


def test_calls_run_in_order_and_errors_come_back() -> None:
    worker = ComputeWorker()
    seen: list[object] = []
    done = threading.Event()

    def fail() -> tuple[object, float]:
        raise ValueError("boom")

    worker.run(lambda: ("a", 0.0), lambda r, e, s: seen.append(r))
    worker.run(fail, lambda r, e, s: seen.append(type(e).__name__))
    worker.run(lambda: ("b", 0.0), lambda r, e, s: (seen.append(r), done.set()))
    assert done.wait(10)
    assert seen == ["a", "ValueError", "b"]
    worker.stop()
