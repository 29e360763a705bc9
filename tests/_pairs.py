"""One way to get a connected pair through a real listener in tests (whatever the transport,
config or front end), closed on exit the way independent peers close: concurrently."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio

from aiordma.testing import aclose_together

E = TypeVar("E")


@asynccontextmanager
async def served_pair(listener: Any, connect: Callable[[int], Awaitable[E]]) -> AsyncIterator[tuple[E, E]]:
    """``async with served_pair(await create_listener(...), lambda port: connect(..., port)) as (client, server)``

    The listener serves until the one connection was accepted, then closes; both ends are
    closed on exit with :func:`aiordma.testing.aclose_together`."""
    send, receive = anyio.create_memory_object_stream[Any](1)
    async with listener, send, receive:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, send.send)
                client = await connect(listener.port)
                server = await receive.receive()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # (connect failed: raise its own error, as the test expects it)
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    try:
        yield client, server
    finally:
        await aclose_together(client, server)
