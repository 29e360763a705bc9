"""A close is a close (issue 31, item 2), with the peer in a process of its own
(``tests/_slow_peer_proc.py``).

* A closer whose peer reads late: ``aclose()`` (``writer.close(); await writer.wait_closed()``)
  returns only once the peer has everything, however long the reader pauses while its host is
  alive -- not after a fixed time -- and the reader gets every byte and a clean end.  Before,
  the asyncio idiom returned after 5 s without progress and aborted: the reader got part of it,
  then a reset.
* A producer that never receives learns of its peer's close at its next send, on trio too, and
  the closer does not linger while the producer goes on sending (before: trio's producer
  "sent" 1.6 GB after the peer's close with no error, and the closer's ``aclose()`` took 19 s).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import anyio
import pytest

from anyio.abc import SocketAttribute

from aiordma._tcp.links import unacknowledged

from ._listener_proc import client_context
from ._slow_peer import Peer, loop_name, open_sender

pytestmark = pytest.mark.anyio

#: how long the reader pauses: past the 5 s without progress after which closing gave up before
PAUSE = 6.0
#: bytes that wait at this side (the reader's kernel and process took what they take) when it closes
PENDING = 1 << 20
CHUNK = 256 << 10


def pending(api: str, conn: Any) -> int:
    """Bytes of ours the reader's side has not acknowledged yet (queued here or in flight)."""
    if api in ("channel", "stream"):
        return unacknowledged(conn.extra(SocketAttribute.raw_socket))
    writer = conn[1]
    return int(writer.transport.get_write_buffer_size()) + unacknowledged(writer.get_extra_info("socket"))


async def write_then_close(api: str, conn: Any) -> tuple[list[bytes], int, float]:
    """Send 256 KiB chunks until the reader's side has stopped taking them (``PENDING`` bytes
    wait here), then close at once: channels and streams ``aclose``, the asyncio writer
    ``close(); await wait_closed()``.  Returns what was sent, what was pending at the close,
    and when the close returned."""
    data: list[bytes] = []
    while True:
        if (waiting := pending(api, conn)) >= PENDING:
            await anyio.sleep(0.3)  # (does it stay? an asyncio reader's process takes more as it goes)
            if (waiting := pending(api, conn)) >= PENDING:
                break
        assert len(data) < 256, f"the reader's side took {len(data) * CHUNK} bytes without reading"
        chunk = len(data).to_bytes(4, "big") * (CHUNK // 4)
        data.append(chunk)
        if api in ("channel", "stream"):
            await conn.send(chunk)
        else:
            conn[1].write(chunk)
        await anyio.sleep(0.005)  # (lets the peer's kernel and process take what they take)
    if api in ("channel", "stream"):
        await conn.aclose()
    else:
        conn[1].close()
        await conn[1].wait_closed()
    return data, waiting, time.monotonic()


def close_cases() -> list[Any]:
    out = []
    for tls in (False, True):
        for api in ("asyncio", "channel", "stream"):
            # (the idiom, and TLS streams, in the quick suite; the rest is slow: a pause each)
            marks = () if api == "asyncio" or (tls and api == "stream") else (pytest.mark.slow,)
            out.append(pytest.param(api, tls, id=f"{api}-{'tls' if tls else 'tcp'}", marks=marks))
    return out


@pytest.mark.paced
@pytest.mark.parametrize(("api", "tls"), close_cases())
async def test_a_close_waits_for_a_reader_that_pauses(anyio_backend: Any, api: str, tls: bool, tlsdir: str) -> None:
    """The reader (listening, in its own process) pauses ``PAUSE`` s before it reads; the closer
    sends until the reader's side takes no more (``PENDING`` bytes wait on this side), then
    closes at once.  The close returns after the reader read it all, with no error; the reader
    got every byte in order and a clean end.  (TLS on trio closed after 5 s without the peer's
    close_notify, resetting what the reader had not taken.)"""
    loop = loop_name(anyio_backend)
    if api == "asyncio" and loop == "trio":
        pytest.skip("aiordma.asyncio runs on asyncio loops")
    tdir = tlsdir if tls else "-"
    peer = Peer(loop, api, "serve", 0, tdir, PAUSE, 0)
    try:
        port = int((await peer.line(30)).split()[1])
        conn = await open_sender(api, port, client_context(tdir), keepalive=1.0)
        connected = time.monotonic()
        with anyio.fail_after(PAUSE + 60):
            data, waiting, closed = await write_then_close(api, conn)
        result = json.loads(await peer.line(60))
    finally:
        peer.close()
    assert result["error"] == "" and result["close_error"] == "", result
    assert result["received"] == len(data) * CHUNK, result
    assert result["sha256"] == hashlib.sha256(b"".join(data)).hexdigest(), result
    # the close waited for the reader: it returned once the reader had read (not before)
    assert closed - connected >= PAUSE - 0.5, (closed - connected, waiting, result)


async def test_a_passed_through_stream_close_waits_for_a_reader_that_pauses(
    anyio_backend: Any, tlsdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with ``aiordma.asyncio``'s streams passed through (unframed after the handshake,
    both ends; the others here run them framed): a close that ends the socket once the bytes
    reached this side's kernel -- asyncio's own -- lost the paused reader's tail to a reset."""
    if loop_name(anyio_backend) == "trio":
        pytest.skip("aiordma.asyncio runs on asyncio loops")
    monkeypatch.setenv("AIORDMA_TEST_STREAMS_PASS_THROUGH", "1")
    await test_a_close_waits_for_a_reader_that_pauses(anyio_backend, "asyncio", False, tlsdir)


@pytest.mark.parametrize("api", ["channel", "stream"])
async def test_a_producer_learns_of_the_peers_close_at_its_next_send(anyio_backend: Any, api: str) -> None:
    """The peer (listening, in its own process) reads 1 MiB and closes; this side only ever
    sends.  Once the peer's close returned (it printed its result), this side's next send fails
    with ``BrokenResourceError``; and the peer's close did not linger while we went on sending."""
    loop = loop_name(anyio_backend)
    peer = Peer(loop, api, "serve", 0, "-", 0.0, 1 << 20)
    chunk = b"p" * (64 << 10)
    try:
        port = int((await peer.line(30)).split()[1])
        conn = await open_sender(api, port, None, keepalive=5.0)
        result: dict[str, Any] | None = None
        sends_after = 0
        error: BaseException | None = None

        async def peer_done() -> None:
            nonlocal result
            result = json.loads(await peer.line(30))

        async with conn, anyio.create_task_group() as tg:
            tg.start_soon(peer_done)
            with anyio.fail_after(30):
                try:
                    while True:
                        if result is not None:
                            await anyio.sleep(0.1)  # (the close's reset, if any, is in)
                            sends_after += 1
                        await conn.send(chunk)
                        if sends_after:
                            break
                except anyio.BrokenResourceError as exc:
                    error = exc
    finally:
        peer.close()
    assert result is not None
    assert result["error"] == "" and result["close_error"] == "", result
    assert result["received"] >= 1 << 20, result
    assert error is not None, f"a send after the peer's close returned went through ({result})"
    assert sends_after <= 1, (sends_after, error)  # (asyncio reads all along: it may learn earlier)
    # told the producer (its kernel has our CLOSE), the closer stopped lingering
    assert result["closing"] < 2.0, result


def unread_cases() -> list[Any]:
    out = []
    for peer in ("same", "other"):
        for tls in (False, True):
            for api in ("asyncio", "channel", "stream"):
                quick = tls and (api == "stream" or (api == "asyncio" and peer == "other"))
                out.append(pytest.param(api, tls, peer, id=f"{api}-{'tls' if tls else 'tcp'}-{peer}-loop",
                                        marks=() if quick else (pytest.mark.slow,)))  # fmt: skip
    return out


@pytest.mark.paced
@pytest.mark.parametrize(("api", "tls", "peer_loop"), unread_cases())
async def test_a_closer_with_unread_bytes_delivers_all_and_does_not_wait_for_the_peers_close(
    anyio_backend: Any, api: str, tls: bool, peer_loop: str, tlsdir: str
) -> None:
    """The peer (its own process, on this loop or another: trio against asyncio) sends 256 KiB
    that this side never reads, pauses 1 s, reads the 2 MiB this side sends, then keeps the
    connection open 6 s before it closes.  This side sends and closes at once.  Its close
    returns once the peer has everything -- not at once with a reset that purges what the peer
    had not read (before, on trio over TLS: 112 KiB of 2 MiB arrived), and not when the peer
    closes or after a fixed 5 s (trio over TLS waited for the peer's close_notify, which a peer
    that closes later sends late or never) -- and the peer got every byte."""
    loop = loop_name(anyio_backend)
    if api == "asyncio" and loop == "trio":
        pytest.skip("aiordma.asyncio runs on asyncio loops")
    tdir = tlsdir if tls else "-"
    size, hold = 2 << 20, 6.0
    data = [i.to_bytes(4, "big") * (CHUNK // 4) for i in range(size // CHUNK)]
    their_loop, their_api = loop, api
    if peer_loop == "other":
        their_loop = "asyncio" if loop == "trio" else "trio"
        their_api = "stream" if api == "asyncio" else api  # (aiordma.asyncio's reader/writer is a stream)
    peer = Peer(their_loop, their_api, "serve", 0, tdir, 1.0, size, greet=256 << 10, hold=hold)
    try:
        port = int((await peer.line(30)).split()[1])
        conn = await open_sender(api, port, client_context(tdir), keepalive=1.0)
        await anyio.sleep(0.5)  # (the greeting is in: unread bytes wait at this side)
        with anyio.fail_after(30):
            started = time.monotonic()
            if api == "asyncio":
                for chunk in data:
                    conn[1].write(chunk)
                conn[1].close()
                await conn[1].wait_closed()
            else:
                for chunk in data:
                    await conn.send(chunk)
                await conn.aclose()
            closing = time.monotonic() - started
        result = json.loads(await peer.line(hold + 30))
    finally:
        peer.close()
    assert result["error"] == "", result
    assert result["received"] == size, result
    assert result["sha256"] == hashlib.sha256(b"".join(data)).hexdigest(), result
    assert closing < hold - 3, f"the close took {closing:.1f} s: it waited for the peer's own close"
