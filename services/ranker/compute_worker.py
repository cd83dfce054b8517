"""The service's one compute thread: runs what it is given, one call at a time, in order."""

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("services.ranker.compute")

Done = Callable[[Any, BaseException | None, float], None]


class ComputeWorker:
    """Runs callables on one thread, in submission order.

    `run(fn, done)`: `fn()` returns (result, seconds); `done(result, error, seconds)` is then
    called on the worker thread (post it to your loop). A call given without `done` (a test
    holding the worker) ends by calling `on_idle` instead. `idle`: nothing queued or running.
    """

    def __init__(self, on_idle: Callable[[], None] = lambda: None) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Done | None] | None] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._lock = threading.Lock()
        self._on_idle = on_idle
        self._thread = threading.Thread(target=self._run, name="relaygr-compute", daemon=True)
        self._thread.start()
        self._stopped = False

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def run(self, fn: Callable[[], Any], done: Done | None = None) -> None:
        with self._lock:
            self._pending += 1
        self._calls.put((fn, done))

    def stop(self) -> None:
        """End the thread once what was given before has run."""
        if self._stopped:
            return
        self._stopped = True
        self._calls.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, done = call
            result: Any = None
            error: BaseException | None = None
            seconds = 0.0
            try:
                out = fn()
                if done is not None:
                    result, seconds = out
            except Exception as err:  # delivered to the caller, which fails the job
                error = err
            with self._lock:
                self._pending -= 1
            try:
                if done is not None:
                    done(result, error, seconds)
                else:
                    self._on_idle()
            except RuntimeError:  # its loop closed meanwhile: nobody waits for the result
                _log.debug("a compute result came back after its event loop closed")
