"""The ``aiordma`` command: ``aiordma info`` and ``aiordma demo``.

``aiordma info`` tells what this host has (versions, the native verbs module,
RDMA devices with their ports and GIDs from sysfs) and which transport
``transport="auto"`` would use here, and why.  ``--json`` prints the same as
one JSON object.

``aiordma demo`` runs a byte-stream listener and a channel listener on
127.0.0.1 in this process, connects a client to each, checks that bytes and
messages come back intact (message boundaries, the empty message included),
and prints the transport, the fallback reason and a few figures: 64 B round
trip latency, byte-stream throughput and message rate.  It exits with 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio
from anyio import EndOfStream
from anyio.abc import TaskGroup

from ._api import Channel, Stream, connect, connect_channel, create_channel_listener, create_listener
from ._attributes import TransportAttribute

__all__ = ["main", "build_parser", "collect_info", "read_rdma_devices"]

SYSFS_IB = "/sys/class/infiniband"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MiB = 1 << 20

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


# -- info ----------------------------------------------------------------------


@dataclass
class Gid:
    index: int
    gid: str
    type: str | None
    netdev: str | None


@dataclass
class Port:
    port: int
    state: str | None
    link_layer: str | None
    gids: list[Gid] = field(default_factory=list)


@dataclass
class Device:
    name: str
    node_type: str | None
    ports: list[Port] = field(default_factory=list)
    #: how this device scopes the rkeys a connection grants (None: not asked: no native module)
    remote_keys: str | None = None


def remote_key_scoping(name: str) -> str:
    """How connections on device ``name`` scope the remote keys they grant: the one memory-window
    probe a device makes when it opens (``aiordma._rdma.device``), made here once."""
    from ._rdma.verbs import Context

    with Context(name) as ctx, ctx.alloc_pd() as pd:
        try:
            pd.alloc_mw().close()
        except Exception as exc:  # (RDMAError EOPNOTSUPP: no windows, as on siw)
            return f"a protection domain per connection (no type 2 memory windows: {exc})"
    return "memory windows (type 2): each grant bound to its connection's QP"


def read_rdma_devices(root: str = SYSFS_IB) -> list[Device]:
    """RDMA devices under ``root`` (sysfs), their ports and non-zero GIDs, as sysfs words them.

    The one discovery (``aiordma._rdma.discovery``) reads them; this only keeps sysfs's wording."""
    from ._rdma.discovery import list_devices

    devices = []
    for info in list_devices(sysfs_root=root, query_verbs=False):
        device = Device(info.name, info.node_type)
        for p in info.ports:
            port = Port(p.port, p.state_text, p.link_layer_text)
            port.gids = [Gid(g.index, _readable_gid(str(g.gid)), g.type_text, g.netdev) for g in p.gids]
            device.ports.append(port)
        devices.append(device)
    return devices


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _would_use(policy: str) -> dict[str, Any]:
    """What a client with this transport policy would do on this host."""
    from ._errors import RDMAUnavailableError
    from ._handshake.negotiate import local_offer, resolve_transport

    try:
        choice = resolve_transport(policy)
    except ValueError as exc:
        return {"policy": policy, "transport": None, "reason": str(exc), "error": True}
    try:
        offer = local_offer(choice, "client")
    except RDMAUnavailableError as exc:
        return {"policy": choice, "transport": None, "reason": f"fails with RDMAUnavailableError: {exc}", "error": True}
    if offer.rdma:
        return {"policy": choice, "transport": "rdma", "reason": "if the peer offers RDMA too", "error": False}
    return {"policy": choice, "transport": "tcp", "reason": offer.reason, "error": False}


def _readable_gid(raw: str) -> str:
    """sysfs prints GIDs in full; show them compressed, IPv4-mapped ones with their address
    (``::ffff:198.18.0.1``, the form RoCEv2 uses for an IPv4 address)."""
    import ipaddress

    try:
        address = ipaddress.IPv6Address(raw)
    except ValueError:
        return raw
    if address.ipv4_mapped is not None:
        return f"::ffff:{address.ipv4_mapped}"
    return str(address)


def collect_info(sysfs_root: str = SYSFS_IB) -> dict[str, Any]:
    """Everything ``aiordma info`` prints, as a JSON-ready dict."""
    from . import __version__
    from ._handshake.negotiate import resolve_transport
    from ._rdma.discovery import probe

    try:
        found = probe()
        probe_result: dict[str, Any] = {
            "usable": found.usable,
            "reason": found.reason,
            "native_module": found.native_module,
            "native_reason": found.native_reason,
            "devices": list(found.devices),
        }
    except Exception as exc:  # the probe promises not to raise; say so if it does
        probe_result = {
            "usable": False,
            "reason": f"the probe failed: {exc!r}",
            "native_module": False,
            "native_reason": f"the probe failed: {exc!r}",
            "devices": [],
        }
    env = os.environ.get("AIORDMA_TRANSPORT")
    try:
        default_policy: str | None = resolve_transport(None)
        env_error = None
    except ValueError as exc:
        default_policy = None
        env_error = str(exc)
    return {
        "aiordma": __version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in ("anyio", "trio", "uvloop", "cffi")},
        "native_module": {"available": probe_result["native_module"], "reason": probe_result["native_reason"]},
        "rdma": {
            "usable": probe_result["usable"],
            "reason": probe_result["reason"],
            "sysfs": sysfs_root,
            "sysfs_exists": os.path.isdir(sysfs_root),
            "devices": [asdict(d) for d in _with_scoping(read_rdma_devices(sysfs_root), probe_result["native_module"])],
        },
        "env": {"AIORDMA_TRANSPORT": env},
        "default_policy": default_policy,
        "default_policy_error": env_error,
        "auto": _would_use("auto"),
        "default": _would_use(default_policy) if default_policy is not None else None,
    }


def _with_scoping(devices: list[Device], native: bool) -> list[Device]:
    if native:
        for dev in devices:
            try:
                dev.remote_keys = remote_key_scoping(dev.name)
            except Exception as exc:  # (the device cannot be opened: say so, do not fail info)
                dev.remote_keys = f"unknown (opening {dev.name} failed: {exc})"
    return devices


def _describe_choice(outcome: dict[str, Any]) -> str:
    if outcome["transport"] is None:
        return str(outcome["reason"])
    return f"{outcome['transport']} \u2014 {outcome['reason']}"


def format_info(info: dict[str, Any]) -> str:
    lines = [f"aiordma {info['aiordma']}"]
    py = info["python"]
    lines.append(f"Python {py['version']} ({py['implementation']}, {py['executable']})")
    lines.append(f"platform: {info['platform']}")
    packages = ", ".join(f"{name} {ver or 'not installed'}" for name, ver in info["packages"].items())
    lines.append(f"packages: {packages}")
    native = info["native_module"]
    lines.append(f"native verbs module: {'available' if native['available'] else 'not available'}")
    if native["reason"]:
        lines.append(f"  {native['reason']}")
    rdma = info["rdma"]
    usable = "yes" if rdma["usable"] else "no"
    lines.append(f"RDMA usable: {usable}" + (f" \u2014 {rdma['reason']}" if rdma["reason"] else ""))
    if not rdma["sysfs_exists"]:
        lines.append(f"RDMA devices: none ({rdma['sysfs']} does not exist)")
    elif not rdma["devices"]:
        lines.append(f"RDMA devices: none (in {rdma['sysfs']})")
    else:
        lines.append("RDMA devices:")
        for dev in rdma["devices"]:
            lines.append(f"  {dev['name']}" + (f" ({dev['node_type']})" if dev["node_type"] else ""))
            if dev.get("remote_keys"):
                lines.append(f"    remote keys: {dev['remote_keys']}")
            if not dev["ports"]:
                lines.append("    no ports")
            for port in dev["ports"]:
                lines.append(
                    f"    port {port['port']}: state {port['state'] or '?'}, link layer {port['link_layer'] or '?'}"
                )
                if not port["gids"]:
                    lines.append("      no GIDs")
                for gid in port["gids"]:
                    extra = ", ".join(x for x in (gid["type"], gid["netdev"] and f"netdev {gid['netdev']}") if x)
                    lines.append(f"      gid[{gid['index']}] {gid['gid']}" + (f" ({extra})" if extra else ""))
    env = info["env"]["AIORDMA_TRANSPORT"]
    lines.append(f"AIORDMA_TRANSPORT: {env if env is not None else '(not set)'}")
    if info["default_policy_error"]:
        lines.append(f"  invalid: {info['default_policy_error']}")
    lines.append(f"auto would use: {_describe_choice(info['auto'])}")
    default = info["default"]
    if default is not None and default["policy"] != "auto":
        lines.append(
            f"default policy ({default['policy']}, from AIORDMA_TRANSPORT) would use: {_describe_choice(default)}"
        )
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return EXIT_OK


# -- demo ----------------------------------------------------------------------


class DemoFailure(Exception):
    """A check of the demo failed."""


@dataclass
class DemoResult:
    transport: str
    fallback_reason: str
    checks: list[str]
    rtt_median_us: float
    rtt_p99_us: float
    throughput_mb_s: float
    stream_bytes: int
    message_rate: float
    messages: int


def _pattern(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes (a lost, doubled or moved block shows)."""
    return random.Random(seed).randbytes(n)


def _percentile(sorted_values: Sequence[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, int(round(fraction * (len(sorted_values) - 1)))))
    return sorted_values[index]


Connect = Callable[[], Awaitable[Stream]]

# The byte-stream server understands one mode byte at the start of a connection.
MODE_ECHO = b"E"  # echo every byte back, half-close at EOF
MODE_DRAIN = b"D"  # read to EOF, then answer with the byte count (8 bytes)


async def _receive_exactly(stream: Stream, n: int) -> bytes:
    parts = []
    left = n
    while left:
        chunk = await stream.receive(left)
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def _stream_server(stream: Stream) -> None:
    """Echo (``MODE_ECHO``) or count (``MODE_DRAIN``) what one client sends."""
    async with stream:
        try:
            mode = await stream.receive(1)
            if mode == MODE_ECHO:
                while True:
                    try:
                        data = await stream.receive(MiB)
                    except EndOfStream:
                        break
                    await stream.send(data)
                await stream.send_eof()
            elif mode == MODE_DRAIN:
                total = 0
                while True:
                    try:
                        total += len(await stream.receive(MiB))
                    except EndOfStream:
                        break
                await stream.send(total.to_bytes(8, "big"))
                await stream.send_eof()
            # anything else: close
        except (EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client went away; the client side reports what matters


async def _channel_server(channel: Channel) -> None:
    """Echo every message back."""
    async with channel:
        try:
            async for message in channel:
                await channel.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def _check_stream_echo(connect: Connect, checks: list[str]) -> None:
    stream = await connect()
    async with stream:
        await stream.send(MODE_ECHO)
        sizes = [1, 63, 64, 4096, 65536, 100_000, MiB, 3 * MiB + 5]
        payloads = [_pattern(n, seed) for seed, n in enumerate(sizes)]
        expected = b"".join(payloads)
        received = bytearray()

        async def send_all() -> None:
            for payload in payloads:
                await stream.send(payload)
            await stream.send_eof()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all)
            while True:
                try:
                    received += await stream.receive(MiB)
                except EndOfStream:
                    break
        if bytes(received) != expected:
            shorter = min(len(received), len(expected))
            first = next((i for i, (a, b) in enumerate(zip(received, expected)) if a != b), shorter)
            raise DemoFailure(
                f"byte stream echo differs: sent {len(expected)} bytes, got {len(received)} back, "
                f"first difference at byte {first}"
            )
    checks.append(f"byte stream: {len(expected)} bytes in {len(sizes)} writes echoed back intact, EOF seen")


async def _check_messages(channel: Channel, checks: list[str]) -> None:
    sizes = [0, 1, 7, 64, 0, 4096, 65536, MiB, 17, 0]
    messages = [_pattern(n, seed) for seed, n in enumerate(sizes)]
    got: list[bytes] = []

    async def send_all() -> None:
        for message in messages:
            await channel.send(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send_all)
        for _ in messages:
            got.append(await channel.receive())
    if [len(m) for m in got] != sizes:
        raise DemoFailure(f"message boundaries were not kept: sent sizes {sizes}, received {[len(m) for m in got]}")
    if got != messages:
        bad = next(i for i, (a, b) in enumerate(zip(got, messages)) if a != b)
        raise DemoFailure(f"message {bad} ({sizes[bad]} bytes) came back changed")
    empties = sizes.count(0)
    checks.append(
        f"messages: {len(sizes)} messages (sizes 0..{max(sizes)}, {empties} empty) echoed with boundaries kept"
    )


async def _measure_rtt(connect: Connect, round_trips: int) -> tuple[float, float]:
    stream = await connect()
    async with stream:
        await stream.send(MODE_ECHO)
        payload = _pattern(64, 99)
        for _ in range(min(200, round_trips)):  # warm up
            await stream.send(payload)
            await _receive_exactly(stream, 64)
        times = []
        clock = time.perf_counter_ns
        for _ in range(round_trips):
            t0 = clock()
            await stream.send(payload)
            answer = await _receive_exactly(stream, 64)
            times.append(clock() - t0)
            if answer != payload:
                raise DemoFailure("a 64 B round trip came back changed")
        await stream.send_eof()
        try:
            extra = await stream.receive()
        except EndOfStream:
            pass
        else:
            raise DemoFailure(f"the echo server sent {len(extra)} bytes more than it received")
    times.sort()
    return statistics.median(times) / 1000.0, _percentile(times, 0.99) / 1000.0


async def _measure_throughput(connect: Connect, total: int) -> float:
    stream = await connect()
    async with stream:
        await stream.send(MODE_DRAIN)
        block = _pattern(MiB, 5)
        start = time.perf_counter()
        left = total
        while left:
            n = min(left, MiB)
            await stream.send(block if n == MiB else block[:n])
            left -= n
        await stream.send_eof()
        answer = await _receive_exactly(stream, 8)
        elapsed = time.perf_counter() - start
        try:
            await stream.receive()
        except EndOfStream:
            pass
        else:
            raise DemoFailure("the draining server sent more than its count")
    count = int.from_bytes(answer, "big")
    if count != total:
        raise DemoFailure(f"the server received {count} bytes of the {total} sent")
    return total / elapsed / 1e6


async def _measure_message_rate(channel: Channel, count: int) -> float:
    message = _pattern(64, 3)

    async def send_all() -> None:
        for _ in range(count):
            await channel.send(message)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(send_all)
        for _ in range(count):
            if await channel.receive() != message:
                raise DemoFailure("a 64 B message came back changed")
    return count / (time.perf_counter() - start)


def demo_host() -> str:
    """Where the demo listens: an address an RDMA device serves when this host
    can do RDMA (RDMA needs the device behind the address), else loopback."""
    from ._rdma.discovery import probe, rdma_address

    if probe().usable:
        address = rdma_address()
        if address is not None:
            return address
    return "127.0.0.1"


async def run_demo(
    transport: str | None, total_bytes: int, messages: int, round_trips: int, host: str = "127.0.0.1"
) -> DemoResult:
    checks: list[str] = []
    async with (
        await create_listener(host, 0, transport=transport) as stream_listener,
        await create_channel_listener(host, 0, transport=transport) as channel_listener,
        anyio.create_task_group() as servers,
    ):
        tg: TaskGroup = servers
        tg.start_soon(stream_listener.serve, _stream_server, tg)
        tg.start_soon(channel_listener.serve, _channel_server, tg)

        async def connect_stream() -> Stream:
            return await connect(host, stream_listener.port, transport=transport)

        async with await connect_stream() as first:
            kind = first.extra(TransportAttribute.transport)
            reason = first.extra(TransportAttribute.fallback_reason)
            await first.send(b"?")  # not a mode: the server closes
        await _check_stream_echo(connect_stream, checks)
        async with await connect_channel(host, channel_listener.port, transport=transport) as channel:
            if channel.extra(TransportAttribute.transport) != kind:
                raise DemoFailure("the channel and the byte stream run on different transports")
            await _check_messages(channel, checks)
            rtt_median, rtt_p99 = await _measure_rtt(connect_stream, round_trips)
            throughput = await _measure_throughput(connect_stream, total_bytes)
            rate = await _measure_message_rate(channel, messages)
            await channel.send_eof()
            try:
                extra = await channel.receive()
            except EndOfStream:
                pass
            else:
                raise DemoFailure(f"the channel server sent an extra message of {len(extra)} bytes")
        checks.append(f"throughput run: the server counted all {total_bytes} bytes")
        tg.cancel_scope.cancel()
    return DemoResult(kind, reason, checks, rtt_median, rtt_p99, throughput, total_bytes, rate, messages)


def _size(text: str) -> int:
    """A byte count: ``65536``, ``64K``, ``64M``, ``1G`` (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = 1
    if raw and raw[-1] in units:
        factor = units[raw[-1]]
        raw = raw[:-1]
    try:
        value = int(raw) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 65536, 64K, 64M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte: {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _human_bytes(n: int) -> str:
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"


def format_demo(result: DemoResult, backend: str, policy: str, host: str = "127.0.0.1") -> str:
    lines = [f"aiordma demo: backend {backend}, transport policy {policy}, {host}, client and server in one process"]
    lines.append(f"transport: {result.transport}")
    lines.append(f"fallback reason: {result.fallback_reason or '(none: the data runs on RDMA)'}")
    for check in result.checks:
        lines.append(f"ok  {check}")
    rows = [
        ("64 B round trip, median", f"{result.rtt_median_us:.1f} \u00b5s"),
        ("64 B round trip, p99", f"{result.rtt_p99_us:.1f} \u00b5s"),
        (f"byte stream, {_human_bytes(result.stream_bytes)} in 1 MiB writes", f"{result.throughput_mb_s:.0f} MB/s"),
        (f"messages, {result.messages} x 64 B echoed", f"{result.message_rate:,.0f} msgs/s"),
    ]
    width = max(len(name) for name, _ in rows)
    lines.append("")
    lines.append(f"{'measure'.ljust(width)}  value")
    lines.append(f"{'-' * width}  {'-' * 14}")
    lines.extend(f"{name.ljust(width)}  {value}" for name, value in rows)
    return "\n".join(lines)


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def cmd_demo(args: argparse.Namespace) -> int:
    from ._errors import AiordmaError, RDMAUnavailableError
    from ._handshake.negotiate import resolve_transport

    try:
        policy = resolve_transport(args.transport)
    except ValueError as exc:
        print(f"aiordma demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    backend = "asyncio"
    options: dict[str, Any] = {}
    if args.backend == "trio":
        backend = "trio"
    elif args.backend == "uvloop":
        try:
            import uvloop
        except ImportError:
            print("aiordma demo: error: --backend uvloop needs uvloop (pip install 'aiordma[uvloop]')", file=sys.stderr)
            return EXIT_USAGE
        options["loop_factory"] = uvloop.new_event_loop

    host = args.host or demo_host()

    async def bounded() -> DemoResult:
        with anyio.fail_after(args.timeout):
            return await run_demo(policy, args.bytes, args.messages, args.round_trips, host)

    try:
        result = anyio.run(bounded, backend=backend, backend_options=options)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as raised:
        leaf = _leaf(raised)
        if isinstance(leaf, ModuleNotFoundError):
            print(f"aiordma demo: error: backend {args.backend!r} is not available: {leaf}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(leaf, RDMAUnavailableError):
            print(f"aiordma demo: error: transport {policy!r} is not available here: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, DemoFailure):
            print(f"aiordma demo: FAILED: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, TimeoutError):
            print(f"aiordma demo: FAILED: did not finish within {args.timeout} s", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, (AiordmaError, anyio.BrokenResourceError, anyio.ClosedResourceError, EndOfStream, OSError)):
            print(f"aiordma demo: FAILED: {type(leaf).__name__}: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        traceback.print_exception(raised)
        print(f"aiordma demo: FAILED: unexpected {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return EXIT_FAILED
    print(format_demo(result, args.backend, policy, host))
    return EXIT_OK


# -- perf ------------------------------------------------------------------------


def _loop_of(name: str, prog: str) -> tuple[str, dict[str, Any]] | None:
    if name == "trio":
        return "trio", {}
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            print(f"{prog}: error: --backend uvloop needs uvloop (pip install 'aiordma[uvloop]')", file=sys.stderr)
            return None
        return "asyncio", {"loop_factory": uvloop.new_event_loop}
    return "asyncio", {}


def _sizes(text: str) -> list[int]:
    return [_size(part) for part in text.split(",") if part.strip()]


def cmd_perf(args: argparse.Namespace) -> int:
    from . import _perf

    prog = f"aiordma perf {args.role}"
    loop = _loop_of(args.backend, prog)
    if loop is None:
        return EXIT_USAGE
    if args.role == "server":

        def ready(ports: list[int]) -> None:
            print(f"aiordma perf server: listening on {args.host} ports {ports[0]}-{ports[-1]} "
                  f"(poll modes {', '.join(_perf.POLL_MODES)})", flush=True)  # fmt: skip

        try:
            anyio.run(lambda: _perf.serve(args.host, args.port, max_connections=args.max_connections,
                                          on_ready=ready), backend=loop[0], backend_options=loop[1])  # fmt: skip
        except KeyboardInterrupt:
            return EXIT_OK
        return EXIT_OK
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    polls = [m.strip() for m in args.poll.split(",") if m.strip()]
    for t in transports:
        if t not in ("rdma", "tcp"):
            print(f"{prog}: error: unknown transport {t!r} (rdma, tcp)", file=sys.stderr)
            return EXIT_USAGE
    for m in polls:
        if m not in _perf.POLL_MODES:
            print(f"{prog}: error: unknown poll mode {m!r} ({', '.join(_perf.POLL_MODES)})", file=sys.stderr)
            return EXIT_USAGE
    if not args.local and not args.host:
        print(f"{prog}: error: give the server's HOST, or --local", file=sys.stderr)
        return EXIT_USAGE
    host = args.host or demo_host()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in ("send", "read", "write"):
            print(f"{prog}: error: unknown operation {o!r} (send, read, write)", file=sys.stderr)
            return EXIT_USAGE
    total = len(ops) * len(args.sizes) * 2 * sum(len(polls) if t == "rdma" else 1 for t in transports)
    bar = _perf.Progress(total, enabled=not args.no_progress)

    async def client(ports: list[int]) -> list[_perf.PerfLine]:
        return await _perf.run_client(
            host, ports, transports=transports, polls=polls, sizes=args.sizes, iterations=args.iterations,
            bw_bytes=args.bw_bytes, latency_bytes=args.lat_bytes, bw_messages=args.bw_messages, timeout=args.timeout,
            progress=bar.update, ops=ops,
        )  # fmt: skip

    async def local() -> list[_perf.PerfLine]:
        ports: list[int] = []
        ready = anyio.Event()

        def on_ready(p: list[int]) -> None:
            ports.extend(p)
            ready.set()

        lines: list[_perf.PerfLine] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _perf.serve(host, 0, on_ready=on_ready))
            await ready.wait()
            try:
                lines = await client(ports)
            finally:
                tg.cancel_scope.cancel()
        return lines

    async def remote() -> list[_perf.PerfLine]:
        return await client([args.port + i for i in range(len(_perf.POLL_MODES))])

    try:
        lines = anyio.run(local if args.local else remote, backend=loop[0], backend_options=loop[1])
    finally:
        bar.close()
    meta = {
        "host": host, "local": bool(args.local), "backend": args.backend, "sizes": args.sizes,
        "iterations": args.iterations, "bw_bytes": args.bw_bytes, "python": platform.python_version(),
        "aiordma": _version("aiordma"),
    }  # fmt: skip
    if args.json:
        print(_perf.to_json(lines, meta))
    else:
        where = "client and server in this process" if args.local else f"server {host}:{args.port}"
        print(f"aiordma perf ({where}, {args.backend})")
        print(_perf.format_table(lines))
    if args.plot:
        try:
            _perf.write_plot(lines, args.plot, title=f"aiordma perf ({'local' if args.local else host}, {args.backend})")
        except RuntimeError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"plot written to {args.plot}", file=sys.stderr)
    failed = [line for line in lines if line.note]
    for line in failed:
        print(f"{prog}: {line.label}: {line.note}", file=sys.stderr)
    return EXIT_FAILED if failed and len(failed) == len(lines) else EXIT_OK


# -- entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiordma",
        description="Async RDMA queue pairs with automatic TCP fallback: host information and a loopback demo.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('aiordma') or 'unknown'}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    info = sub.add_parser(
        "info",
        help="what this host has, and which transport 'auto' would use",
        description=(
            "Print the versions, the native verbs module, the RDMA devices (ports, states, GIDs from sysfs), "
            "$AIORDMA_TRANSPORT and the transport that transport='auto' would use here, with the reason."
        ),
    )
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo",
        help="echo bytes and messages over the best transport here and measure",
        description=(
            "Start a byte-stream listener and a channel listener in this process (on an address an RDMA device "
            "serves when there is one, else 127.0.0.1), connect to each, check that bytes and messages come back "
            "intact, and print the transport, the fallback reason, latency, throughput and message rate."
        ),
    )
    demo.add_argument("--host", default=None, help="address to listen and connect on (default: see above)")
    demo.add_argument(
        "--transport",
        choices=("auto", "tcp", "rdma"),
        default=None,
        help="transport policy (default: $AIORDMA_TRANSPORT, else auto)",
    )
    demo.add_argument(
        "--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio", help="event loop (default: asyncio)"
    )
    demo.add_argument(
        "--bytes",
        type=_size,
        default=64 * MiB,
        metavar="N",
        help="bytes for the throughput run, e.g. 64M (default 64M)",
    )
    demo.add_argument(
        "--messages", type=_positive, default=20_000, metavar="N", help="64 B messages for the rate (default 20000)"
    )
    demo.add_argument(
        "--round-trips", type=_positive, default=2000, metavar="N", help="64 B round trips for latency (default 2000)"
    )
    demo.add_argument("--timeout", type=float, default=120.0, metavar="S", help="give up after S seconds (default 120)")
    demo.set_defaults(func=cmd_demo)

    perf = sub.add_parser(
        "perf",
        help="latency and bandwidth over message sizes, per transport and poll mode",
        description=(
            "Like ib_send_lat / ib_write_bw: 'aiordma perf server' listens (three ports, one per RDMA poll mode); "
            "'aiordma perf client HOST' measures round-trip latency (p50/p99/p99.9) and bandwidth for each size, "
            "over RDMA in each poll mode and over TCP, and prints a table with ratios to TCP.  --local runs both "
            "in this process.  --plot FILE.png draws latency and bandwidth against size; --json prints the data."
        ),
    )
    perf_sub = perf.add_subparsers(dest="role", metavar="ROLE")
    perf_sub.required = True
    server = perf_sub.add_parser("server", help="serve perf clients")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    server.add_argument("--port", type=int, default=18515, help="first of three ports (default 18515)")
    server.add_argument("--max-connections", type=_positive, default=None, metavar="N",
                        help="stop after serving N connections (default: run until interrupted)")  # fmt: skip
    client = perf_sub.add_parser("client", help="measure against a perf server (or --local)")
    client.add_argument("host", nargs="?", default=None, help="the server's address")
    client.add_argument("--local", action="store_true", help="run the server in this process too")
    client.add_argument("--port", type=int, default=18515, help="the server's first port (default 18515)")
    client.add_argument("--transports", default="rdma,tcp", help="comma-separated: rdma,tcp (default both)")
    client.add_argument("--poll", default=",".join(("event", "adaptive", "busy")),
                        help="RDMA poll modes, comma-separated (default event,adaptive,busy)")  # fmt: skip
    client.add_argument("--sizes", type=_sizes, default=[64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20,
                                                          4 << 20, 16 << 20],
                        help="message sizes, comma-separated (default 64,1K,16K,64K,256K,1M,4M,16M)")  # fmt: skip
    client.add_argument("--ops", default="send",
                        help="comma-separated: send (messages), read, write (one-sided, against memory the "
                             "server exposes; registered buffers on both sides) (default send)")  # fmt: skip
    client.add_argument("--iterations", type=_positive, default=1000, help="round trips per size (default 1000)")
    client.add_argument("--lat-bytes", type=_size, default=64 * MiB, metavar="N",
                        help="cap the round trips of a size at N bytes' worth (default 64M)")  # fmt: skip
    client.add_argument("--bw-bytes", type=_size, default=64 * MiB, metavar="N",
                        help="bytes sent per size for bandwidth (default 64M)")  # fmt: skip
    client.add_argument("--bw-messages", type=_positive, default=20_000, metavar="N",
                        help="... and at most N messages (default 20000)")  # fmt: skip
    client.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per run (default 300 s)")
    client.add_argument("--plot", metavar="FILE.png", default=None, help="write a plot (needs matplotlib)")
    client.add_argument("--json", action="store_true", help="print JSON instead of the table")
    client.add_argument("--no-progress", action="store_true", help="no progress bar")
    for p in (server, client):
        p.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                       help="event loop (default asyncio)")  # fmt: skip
        p.set_defaults(func=cmd_perf)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
