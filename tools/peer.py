"""The far end of the cross-host tests: a small aiordma service for host a of the two-guest bed.

    python -m tools.peer [--host ADDR] [--timeout S] [--victim PORT]

Listens on ``ADDR`` (default ``$AIORDMA_HOST_ADDRESS``) with ``transport="rdma"`` (strict: a
cross-host test that silently ran on TCP would prove nothing; ``--transport tcp`` only for the
host's check of the suite itself):

* port 7100, message channels (16 MiB messages at most):
  * ``ECHO <payload>`` -> ``<payload>`` back;
  * ``SUM <n>`` -> receives the next message into a ``RegisteredBuffer`` of ``n`` bytes
    (``receive_into``: zero copy on a rendezvous) and answers its SHA-256;
  * ``EXPOSE <n> <seed>`` -> exposes ``n`` bytes (``seed``'s pattern) for reading and writing,
    sends the descriptor, and on the next message (``DONE``) answers the SHA-256 of what the
    buffer then holds (what the client wrote landed, and nothing else changed);
  * ``SINK`` -> takes messages until ``END`` and answers ``<count> <SHA-256 of them all>``;
  * ``SOURCE <n>`` -> sends messages of ``n`` bytes until the connection ends (120 s at most:
    then ``END``), for a test that only receives;
  * ``SENDCLOSE <n> <seed> <eof>`` -> sends ``n`` bytes (``seed``'s pattern) and ``tail``, then
    (with ``eof`` 1: after ``send_eof``) closes the connection at once (the close test);
  * ``LATE <name> [<seconds>]`` -> names this connection, waits 0.3 s (or ``seconds``: a reader
    that pauses), then receives until EOF and records ``<count> <SHA-256>`` of what came as its
    ``detail`` (the close test's mirror: the client closes right after sending);
  * ``TAG <name>`` -> names this connection in the service's record of how connections ended;
    ``STATUS <name>`` -> that record as JSON (``error``: the exception's type or null,
    ``idle``: seconds from the last message received to the end), waiting up to 20 s for it;
  * ``NETEM <spec>`` -> ``tc netem`` on this host's wire NIC (``NETEM`` alone: back to the
    wire's usual qdisc, ``tools._guest.WIRE_QDISC``);
  * ``VICTIM`` -> starts a second service process (channels on port 7102) and answers once it
    listens; ``KILL`` -> SIGKILLs it (the process-crash test) and answers ``killed``;
  * ``QUIT`` -> the service ends (so does ``--timeout``, 1800 s by default: bounded);
* port 7101, byte streams: echoes everything until EOF;
* port 7103: the far ends of the conformance suite's ``twohost`` pairs
  (:mod:`tools.remote_end`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import anyio

import aiordma
from tools.remote_end import serve_remote_ends

CHANNEL_PORT = 7100
STREAM_PORT = 7101
MAX_MESSAGE = 16 << 20


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes both hosts can make from ``seed``."""
    return random.Random(seed).randbytes(n)


VICTIM_PORT = 7102
_NETEM = re.compile(r"^[a-z0-9.% ]{0,80}$")


@dataclasses.dataclass
class _Record:
    tag: str = ""
    error: str | None = None
    detail: str = ""
    last: float = dataclasses.field(default_factory=time.monotonic)
    idle: float = 0.0
    ended: anyio.Event = dataclasses.field(default_factory=anyio.Event)


@dataclasses.dataclass
class _Service:
    stop: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    records: list[_Record] = dataclasses.field(default_factory=list)
    victim: subprocess.Popen[str] | None = None
    host: str = ""
    transport: str = "rdma"

    def record(self) -> _Record:
        rec = _Record()
        self.records.append(rec)
        return rec

    def end(self, rec: _Record, exc: BaseException | None) -> None:
        rec.idle = time.monotonic() - rec.last
        if exc is not None and not isinstance(exc, anyio.EndOfStream):
            rec.error, rec.detail = type(exc).__name__, str(exc)
        rec.ended.set()


async def _run(argv: list[str]) -> str:
    done = await anyio.run_process(argv, check=False, stderr=subprocess.STDOUT)
    return "ok" if done.returncode == 0 else "error " + done.stdout.decode(errors="replace").strip()


class _CloseNow(Exception):
    """A verb's last act: the service closes this connection in order, at once."""


async def _command(svc: _Service, rec: _Record, ch: aiordma.Channel, verb: bytes, rest: bytes) -> bool:
    """One request; False when the service is told to quit."""
    if verb == b"ECHO":
        await ch.send(rest)
    elif verb == b"SUM":
        with aiordma.RegisteredBuffer(int(rest)) as buf:
            n = await ch.receive_into(buf)
            rec.last = time.monotonic()
            await ch.send(hashlib.sha256(memoryview(buf)[:n]).hexdigest().encode())
    elif verb == b"EXPOSE":
        size, seed = (int(x) for x in rest.split())
        with aiordma.RegisteredBuffer(size) as buf:
            memoryview(buf)[:] = pattern(size, seed)
            async with ch.expose(buf, read=True, write=True) as remote:
                await ch.send(remote.to_bytes())
                await ch.receive()  # DONE
            await ch.send(hashlib.sha256(buf).hexdigest().encode())
    elif verb == b"SINK":
        digest, count = hashlib.sha256(), 0
        while (msg := await ch.receive()) != b"END":
            rec.last = time.monotonic()
            digest.update(msg)
            count += 1
        await ch.send(b"%d %s" % (count, digest.hexdigest().encode()))
    elif verb == b"SOURCE":
        block = os.urandom(min(int(rest), MAX_MESSAGE))
        with anyio.move_on_after(120):  # (bounded: the test's end or fault ends it first)
            while True:
                await ch.send(block)
                rec.last = time.monotonic()
        await ch.send(b"END")
    elif verb == b"SENDCLOSE":
        size, seed, eof = (int(x) for x in rest.split())
        await ch.send(pattern(size, seed))
        await ch.send(b"tail")
        if eof:
            await ch.send_eof()
        raise _CloseNow  # at once: what was sent is still on its way
    elif verb == b"LATE":
        name, _, pause = rest.decode().partition(" ")
        rec.tag = name
        await anyio.sleep(min(float(pause or 0.3), 300))  # the reader starts late; the client closes right after sending
        digest, count = hashlib.sha256(), 0
        try:
            while True:
                digest.update(await ch.receive())
                count += 1
        except anyio.EndOfStream:
            rec.detail = f"{count} {digest.hexdigest()}"
        raise _CloseNow
    elif verb == b"TAG":
        rec.tag = rest.decode()
        await ch.send(b"ok")
    elif verb == b"STATUS":
        wanted = rest.decode()
        with anyio.move_on_after(20):
            while not any(r.tag == wanted and r.ended.is_set() for r in svc.records):
                await anyio.sleep(0.1)  # (a test's wait for another connection's end; bounded)
        found = [{"error": r.error, "detail": r.detail, "idle": r.idle} for r in svc.records
                 if r.tag == wanted and r.ended.is_set()]  # fmt: skip
        await ch.send(json.dumps(found).encode())
    elif verb == b"NETEM":
        spec = rest.decode()
        if not _NETEM.match(spec):
            await ch.send(b"error: bad netem spec")
        else:
            from tools._guest import wire_nic, wire_qdisc_argv

            nic = wire_nic()
            answer = await _run(wire_qdisc_argv(nic, spec))  # (no spec: the wire's usual qdisc)
            await ch.send(answer.encode())
    elif verb == b"VICTIM":
        await ch.send(await _start_victim(svc))
    elif verb == b"KILL":
        if svc.victim is None:
            await ch.send(b"error: no victim")
        else:
            svc.victim.send_signal(signal.SIGKILL)
            await anyio.to_thread.run_sync(svc.victim.wait)
            svc.victim = None
            await ch.send(b"killed")
    elif verb == b"QUIT":
        svc.stop.set()
        return False
    else:
        await ch.send(b"error: unknown verb " + verb[:40])
    return True


async def _start_victim(svc: _Service) -> bytes:
    if svc.victim is not None:
        svc.victim.kill()
        await anyio.to_thread.run_sync(svc.victim.wait)
    proc = subprocess.Popen([sys.executable, "-m", "tools.peer", "--host", svc.host, "--transport",
                             svc.transport, "--victim", str(VICTIM_PORT), "--timeout", "600"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    line = await anyio.to_thread.run_sync(proc.stdout.readline)
    if not line.startswith("peer: serving"):
        proc.kill()
        proc.wait()
        return b"error: the victim did not start"
    svc.victim = proc
    return b"ok %d" % proc.pid


async def _channel(ch: aiordma.Channel, svc: _Service) -> None:
    rec = svc.record()
    error: BaseException | None = None
    try:
        async with ch:
            while True:
                msg = await ch.receive()
                rec.last = time.monotonic()
                verb, _, rest = msg.partition(b" ")
                if not await _command(svc, rec, ch, verb, rest):
                    return
    except _CloseNow:
        pass  # (closed in order by the async with)
    except Exception as exc:  # (recorded for STATUS: how this connection ended)
        error = exc
        if not isinstance(exc, anyio.EndOfStream):  # (a failed test's other half: in the log)
            print(f"peer: a channel {rec.tag!r} failed: {exc!r} (cause {exc.__cause__!r})", file=sys.stderr, flush=True)
    finally:
        svc.end(rec, error)


async def _stream(s: aiordma.Stream, svc: _Service) -> None:
    rec = svc.record()
    rec.tag = "stream"
    error: BaseException | None = None
    try:
        async with s:
            while True:
                data = await s.receive(1 << 20)
                rec.last = time.monotonic()
                await s.send(data)
    except Exception as exc:  # (recorded, as for channels)
        error = exc
    finally:
        svc.end(rec, error)


async def serve(host: str, timeout: float, transport: str = "rdma", victim: int = 0) -> None:
    svc = _Service(host=host, transport=transport)
    channels = await aiordma.create_channel_listener(host, victim or CHANNEL_PORT, transport=transport,
                                                     max_message_size=MAX_MESSAGE)  # fmt: skip
    try:
        async with channels, anyio.create_task_group() as tg:
            tg.start_soon(channels.serve, lambda ch: _channel(ch, svc), tg)
            if not victim:
                streams = await aiordma.create_listener(host, STREAM_PORT, transport=transport)
                tg.start_soon(streams.serve, lambda s: _stream(s, svc), tg)
                await tg.start(functools.partial(serve_remote_ends, host, transport=transport))
            ports = f":{victim} (channels)" if victim else f":{CHANNEL_PORT} (channels) and :{STREAM_PORT} (streams)"
            print(f"peer: serving on {host}{ports}", flush=True)
            with anyio.move_on_after(timeout):
                await svc.stop.wait()
            tg.cancel_scope.cancel()
    finally:
        if svc.victim is not None:
            svc.victim.kill()
            svc.victim.wait()
    print("peer: done", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tools.peer", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("AIORDMA_HOST_ADDRESS", "198.18.0.1"))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--transport", default="rdma", help="rdma (the bed), or tcp (the suite's own host check)")
    p.add_argument("--victim", type=int, default=0, metavar="PORT", help="(internal) the VICTIM service's process")
    args = p.parse_args()
    anyio.run(serve, args.host, args.timeout, args.transport, args.victim)
    return 0


if __name__ == "__main__":
    sys.exit(main())
