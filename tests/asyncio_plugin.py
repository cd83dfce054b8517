"""Runs `async def` tests, each on a fresh event loop (fixtures stay synchronous).

Registered by tests/conftest.py. A test that is a coroutine function is run to completion by
`asyncio.run`, as the tests used to do themselves: a new loop per test, closed afterwards with
its leftover tasks cancelled. Nothing else is touched: pytest still fails a test that returns an
awaitable instead of awaiting it, and an async generator or async fixture, rather than letting
it pass unrun.
"""

import asyncio
import inspect

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test):
        return None  # pytest's own call, and its checks
    arguments = {name: pyfuncitem.funcargs[name] for name in inspect.signature(test).parameters}
    asyncio.run(test(**arguments))
    return True
