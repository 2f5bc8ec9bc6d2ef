"""No asyncio.wait_for in hearth/: on Python 3.11 it returns its awaitable's result when that finishes in the very turn
a cancellation of the waiting task lands, and drops the cancellation, so a task stopped by cancellation (shutdown,
SIGTERM, a call's end) can go on. `async with asyncio.timeout(...)`, hearth.services.common.lifecycle.event_within or
hearth.events.cancellation.keeping_cancellation (around a nats-py request, which waits with wait_for inside) keep it.

Fails naming each file and line that calls asyncio.wait_for (as `asyncio.wait_for(...)` or a `wait_for` imported
from asyncio); a use that is justified goes in ALLOWED_WAIT_FOR with its reason."""

from __future__ import annotations

import ast
import asyncio
import sys

import pytest

from tests.unit.import_graph import ROOT, SOURCES

# "path relative to the repository" -> why asyncio.wait_for is right there. None is, today.
ALLOWED_WAIT_FOR: dict[str, str] = {}


def wait_for_calls(source: str) -> list[int]:
    """The lines of `source` that call asyncio.wait_for."""
    tree = ast.parse(source)
    asyncio_names = {"asyncio"}
    wait_for_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            asyncio_names |= {alias.asname or alias.name for alias in node.names if alias.name == "asyncio"}
        elif isinstance(node, ast.ImportFrom) and node.module in ("asyncio", "asyncio.tasks"):
            wait_for_names |= {alias.asname or alias.name for alias in node.names if alias.name == "wait_for"}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = node.func
        if (isinstance(called, ast.Attribute) and called.attr == "wait_for" and isinstance(called.value, ast.Name)
                and called.value.id in asyncio_names) or (isinstance(called, ast.Name) and called.id in wait_for_names):
            lines.append(node.lineno)
    return sorted(lines)


def test_hearth_calls_no_asyncio_wait_for():
    offenders = []
    for path in sorted(SOURCES.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in ALLOWED_WAIT_FOR:
            continue
        offenders += [f"{relative}:{line}" for line in wait_for_calls(path.read_text(encoding="utf-8"))]
    assert not offenders, ("asyncio.wait_for drops a cancellation landing as its awaitable ends (Python 3.11); use "
                           "`async with asyncio.timeout(...)`, event_within or keeping_cancellation instead, or allow "
                           "it in ALLOWED_WAIT_FOR with a reason: " + ", ".join(offenders))


def test_every_allowed_use_names_a_file_that_still_calls_it_and_says_why():
    for relative, reason in ALLOWED_WAIT_FOR.items():
        assert reason.strip(), f"{relative}: allowed without a reason"
        path = ROOT / relative
        assert path.is_file() and wait_for_calls(path.read_text(encoding="utf-8")), \
            f"{relative} no longer calls asyncio.wait_for: drop it from ALLOWED_WAIT_FOR"


@pytest.mark.parametrize("source", [
    "import asyncio\nasync def f(aw):\n    return await asyncio.wait_for(aw, 1)\n",
    "import asyncio as aio\nasync def f(aw):\n    return await aio.wait_for(aw, timeout=1)\n",
    "from asyncio import wait_for\nasync def f(aw):\n    return await wait_for(aw, 1)\n",
    "from asyncio import wait_for as bounded\nasync def f(aw):\n    return await bounded(aw, 1)\n",
])
def test_the_guard_sees_each_way_of_calling_it(source):
    assert wait_for_calls(source) == [3]


def test_the_guard_leaves_other_wait_fors_and_mentions_alone():
    source = ('"""Not asyncio.wait_for(...): it drops a cancellation."""\nimport asyncio\n'
              "async def f(condition, ready):\n    # asyncio.wait_for(x) would\n"
              "    await condition.wait_for(ready)\n    async with asyncio.timeout(1):\n        pass\n")
    assert wait_for_calls(source) == []


async def test_what_it_guards_against_python_3_11_drops_the_cancellation():
    """The reason for the guard, shown: asyncio.timeout keeps a cancellation landing as the wait ends; Python 3.11's
    wait_for drops it (3.12's keeps it: there the guard stays as a rule of style)."""
    arrived = asyncio.Event()

    async def waits_once_more_after(use_wait_for: bool) -> str:
        for _ in range(2):
            if use_wait_for:
                await asyncio.wait_for(arrived.wait(), 5)
            else:
                async with asyncio.timeout(5):
                    await arrived.wait()
            arrived.clear()
        return "went on"

    async def cancelled_as_it_arrives(use_wait_for: bool) -> bool:
        waiting = asyncio.create_task(waits_once_more_after(use_wait_for))
        await asyncio.sleep(0.05)
        arrived.set()
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.sleep(0.05)
        arrived.set()
        await asyncio.wait({waiting}, timeout=5)
        return waiting.cancelled()

    assert await cancelled_as_it_arrives(use_wait_for=False)
    if sys.version_info < (3, 12):
        assert not await cancelled_as_it_arrives(use_wait_for=True)
