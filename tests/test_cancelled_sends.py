"""A cancelled send is not a corrupt one (issue 31, item 3).

A ``send()`` cancelled at any await either delivers its message whole or not at all; on a
stream that cannot finish a cut frame (TLS) the connection's sending side breaks for every
sender with an error that says so.  Never does the peer receive, as a message, bytes that were
not sent as that message -- the failure seen on trio over TCP, where an 8 MiB send under
``move_on_after(0.05)`` left a cut frame that the next sends completed with their own bytes.

Each message carries its own id and a checksum of its body, so that the receiver can tell a
message that was sent from one made of pieces of several.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ._send_programs import KINDS, run_program

pytestmark = pytest.mark.anyio


@pytest.mark.paced
async def test_a_send_cancelled_midway_does_not_corrupt_the_next_ones(anyio_backend: Any, tlsdir: str) -> None:
    """The issue's case, on every loop and transport: an 8 MiB message under a 0.05 s timeout
    while the reader has not started, then 9 more of 1 MiB."""
    for kind in KINDS:
        await run_program(kind, tlsdir, [[(8 << 20, 0.05)] + [(1 << 20, None)] * 9], reader_delay=0.3)


PROGRAMS = st.lists(
    st.lists(st.tuples(st.sampled_from([16, 4000, 70000, 1 << 20, 3 << 20]),
                       st.one_of(st.none(), st.floats(0, 0.05))), min_size=1, max_size=4),
    min_size=1, max_size=3,
)  # fmt: skip


@pytest.mark.guest_loops("trio")
@pytest.mark.parametrize("kind", [*KINDS, pytest.param("rdma", id="rxe", marks=pytest.mark.rdma)])
@given(senders=PROGRAMS, reader_delay=st.sampled_from([0.0, 0.02, 0.1]))
@settings(max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "10")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
async def test_cancelled_concurrent_sends_never_deliver_a_message_that_was_not_sent(
    anyio_backend: Any, kind: str, tlsdir: str, senders: list[list[tuple[int, float | None]]], reader_delay: float
) -> None:
    """Random programs of concurrent senders with random timeouts, on every transport -- the
    simulated wire and (in the guest, under asyncio and trio) rxe among them."""
    await run_program(kind, tlsdir, senders, reader_delay)


@pytest.mark.parametrize("kind", KINDS)
async def test_small_messages_behind_a_large_one_all_arrive_before_the_end(anyio_backend: Any, kind: str,
                                                                           tlsdir: str) -> None:  # fmt: skip
    """The example the property found (the full suite, uvloop over TLS): 1 MiB, then three small
    messages, the reader 20 ms late, then the sender's close.  On uvloop over TLS the last ones
    went missing in 99 of 100 runs, and the close reported success: uvloop's TLS dropped what it
    held undecrypted when the connection ended while the reader had paused reading."""
    for _ in range(10):
        await run_program(kind, tlsdir, [[(1 << 20, None), (16, None), (16, None), (16, None)]], 0.02)
