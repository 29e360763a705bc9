"""The rendezvous threshold measured per device (aiordma/_rdma/thresholds.py): the crossover
from one measurement, the file it is kept in, and connections that use it (the simulated wire;
the measurement itself runs in the guest: test_calibrate_measures_the_device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma import RdmaConfig
from aiordma._rdma.constants import DeviceAttr
from aiordma._rdma.thresholds import DEFAULT_RENDEZVOUS, Measured, crossover, device_key, load, save

from ._kinds import channels

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


@given(rates=st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(0.1, 1e4)), min_size=len(SIZES), max_size=len(SIZES)))
def test_the_threshold_is_where_the_rendezvous_keeps_up_from_on(rates: list[tuple[float, float]]) -> None:
    by_rendezvous = [r for r, _ in rates]
    by_slots = [s for _, s in rates]
    t = crossover(SIZES, by_rendezvous, by_slots)
    kept_up = [r >= s for r, s in rates]
    if t == 2 * SIZES[-1]:
        assert not kept_up[-1]  # it never kept up at the largest size
    else:
        i = SIZES.index(t)
        assert all(kept_up[i:])  # from the threshold on, at every larger size
        assert i == 0 or not kept_up[i - 1]  # and not at the size below it


def test_the_crossover_of_the_guests_table() -> None:
    """docs/benchmarks.md, "Where the rendezvous pays" (two processes): 16 MiB was the first size
    where the rendezvous won; the sizes need not come sorted."""
    table = {16 << 10: (1.2, 7.4), 256 << 10: (10.3, 16.5), 1 << 20: (13.4, 19.1), 4 << 20: (11.2, 13.6), 16 << 20: (12.2, 11.0)}
    sizes = list(reversed(table))
    assert crossover(sizes, [table[s][0] for s in sizes], [table[s][1] for s in sizes]) == 16 << 20
    with pytest.raises(ValueError):
        crossover([], [], [])


def _attr(fw: str = "1.0", guid: int = 0x1234) -> DeviceAttr:
    return DeviceAttr(guid, 1 << 40, 0x15B3, 4123, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, fw)


def test_measurements_are_kept_per_device_and_a_bad_file_is_ignored(tmp_path: Path, caplog: Any) -> None:
    path = tmp_path / "rendezvous.json"
    a, b = device_key("mlx5_0", _attr()), device_key("mlx5_0", _attr(fw="2.0"))
    assert a != b and a != device_key("mlx5_1", _attr()) and a != device_key("mlx5_0", _attr(guid=7))
    assert load(a, path) is None
    save(a, Measured(256 << 10, 1.0, {256 << 10: (900.0, 800.0)}), path)
    save(b, Measured(1 << 20, 2.0, {}), path)
    got = load(a, path)
    assert got is not None and got.threshold == 256 << 10 and got.table == {256 << 10: (900.0, 800.0)}
    assert (m := load(b, path)) is not None and m.threshold == 1 << 20  # (the other entry stayed)
    path.write_text("{not json")
    assert load(a, path) is None and "ignoring" in caplog.text
    path.write_text(json.dumps({a: {"threshold": 12}}))  # below what a config accepts
    assert load(a, path) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rendezvous.json"]  # (no temporary left)


@pytest.mark.anyio
async def test_connections_use_their_devices_measured_threshold(anyio_backend: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A device measured once: its connections' messages go by rendezvous from the measured size
    (``RdmaConfig.rendezvous`` left at None); a number in the config wins; unmeasured, 8 MiB."""
    monkeypatch.setenv("AIORDMA_CACHE_DIR", str(tmp_path))
    async with channels("sim") as (a, _b):
        link = a._core.link
        assert a._core.rndv_min == DEFAULT_RENDEZVOUS == link.rendezvous_threshold
        key = device_key(link.device.name, link.device.attr)
    save(key, Measured(512 << 10, 1.0, {}))
    async with channels("sim") as (a, _b):
        assert a._core.link.device.rendezvous_measured is not None, "the device did not reopen"
        assert a._core.rndv_min == 512 << 10
    async with channels("sim", config={"rendezvous": 1 << 20}) as (a, _b):
        assert a._core.rndv_min == 1 << 20
    async with channels("sim", config={"rendezvous": 0}) as (a, _b):
        assert a._core.rndv_min > 1 << 40  # (off)


def test_a_config_refuses_a_tiny_threshold() -> None:
    for bad in (-1, 12, 4095):
        with pytest.raises(ValueError):
            RdmaConfig(rendezvous=bad)
    assert RdmaConfig().rendezvous is None and RdmaConfig(rendezvous=0).rendezvous == 0


@pytest.mark.rdma
def test_calibrate_measures_the_device(tmp_path: Path) -> None:
    """``aiordma info --measure-rendezvous`` on the guest's rxe device: a threshold kept in the
    cache file and shown by ``aiordma info`` (a small size set: the guest is slow)."""
    env = {**__import__("os").environ, "AIORDMA_CACHE_DIR": str(tmp_path)}
    code = (
        "import anyio; from aiordma._cli.calibrate import measure_all; "
        "r = anyio.run(measure_all, None, (256 << 10, 1 << 20)); print(r[0].threshold, r[0].table)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    threshold = int(out.stdout.split()[0])
    assert threshold in (256 << 10, 1 << 20, 2 << 20), out.stdout
    data = json.loads((tmp_path / "rendezvous.json").read_text())
    assert [entry["threshold"] for entry in data.values()] == [threshold]
    info = subprocess.run([sys.executable, "-m", "aiordma", "info"], env=env, capture_output=True, text=True, timeout=120)
    assert "rendezvous from:" in info.stdout and "measured" in info.stdout, info.stdout
