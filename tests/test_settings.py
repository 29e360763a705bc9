"""The eight entry points hand their keyword arguments to one settings object
(aiordma._handshake.settings): every keyword they take reaches it, with the same default and type,
and a bad value is refused before anything connects or binds."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import anyio
import pytest

import aiordma
import aiordma.asyncio as aa
from aiordma._handshake.settings import ClientSettings, ListenerSettings

#: entry point -> (its settings, the keywords that are its own, not connection settings)
ENTRY_POINTS: dict[Callable[..., Any], tuple[type[Any], set[str]]] = {
    aiordma.connect: (ClientSettings, set()),
    aiordma.connect_channel: (ClientSettings, set()),
    aa.open_connection: (ClientSettings, {"limit", "pass_through"}),  # (True in asyncio's front ends)
    aa.create_connection: (ClientSettings, {"pass_through"}),
    aiordma.create_listener: (ListenerSettings, set()),
    aiordma.create_channel_listener: (ListenerSettings, set()),
    aa.start_server: (ListenerSettings, {"limit", "start_serving", "pass_through"}),
    aa.create_server: (ListenerSettings, {"start_serving", "pass_through"}),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_keyword_reaches_the_settings_with_its_default_and_type(entry: Callable[..., Any]) -> None:
    settings, own = ENTRY_POINTS[entry]
    fields = {f.name: f for f in dataclasses.fields(settings)}
    keywords = {name: p for name, p in inspect.signature(entry).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert own <= set(keywords)
    for name, param in keywords.items():
        if name in own:
            continue
        assert name in fields, f"{entry.__name__}({name}=...) would be dropped: add it to {settings.__name__}"
        assert param.default == fields[name].default, f"{entry.__name__}: {name}'s default differs"
        assert param.annotation == fields[name].type, f"{entry.__name__}: {name}'s type differs"


def test_the_check_catches_a_dropped_keyword() -> None:
    async def connect(host: str, port: int, *, transport: str | None = None, brand_new: int = 0) -> None: ...

    keywords = inspect.signature(connect).parameters
    assert "brand_new" in keywords and "brand_new" not in {f.name for f in dataclasses.fields(ClientSettings)}


def test_settings_take_what_the_entry_point_got() -> None:
    def entry(host: str, port: int, *, keepalive: float | None = 5.0, limit: int = 3) -> ClientSettings:
        return ClientSettings.of(locals())

    settings = entry("h", 1, keepalive=7.0)
    assert settings.keepalive == 7.0 and settings.transport is None


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_bad_settings_are_refused_before_connecting_or_binding(anyio_backend: str) -> None:
    with anyio.fail_after(5):
        with pytest.raises(ValueError, match="keepalive"):
            await aiordma.connect("192.0.2.1", 9, keepalive=0)  # (TEST-NET: a connect would hang)
        with pytest.raises(ValueError, match="keepalive"):
            await aa.open_connection("192.0.2.1", 9, keepalive=-1)
        with pytest.raises(ValueError, match="at least 1"):
            await aiordma.create_listener("127.0.0.1", 0, max_handshakes=0)
        with pytest.raises(ValueError, match="hello_timeout"):
            await aa.start_server(lambda r, w: None, "127.0.0.1", 0, hello_timeout=0)
