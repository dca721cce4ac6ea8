"""Metering: GPU-hours (share, whole, MIG, several GPUs), periods, prices, the ledger's record of
GPUs, the report's CSV/JSON shapes through the CLI and the broker, and the README's sample."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from metering_sample import COMMAND, run_readme_command
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.local.store import MIGRATIONS
from jupyter_gpupool.core.metering import DeviceInfo, Interval, Prices, columns, gpu_share, report_rows
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB, MIB

REPO = Path(__file__).resolve().parent.parent
HOUR = 3600.0

A100 = DeviceInfo("GPU-a", "A100-SXM4-80GB", 80 * GIB)
A100_B = DeviceInfo("GPU-b", "A100-SXM4-80GB", 80 * GIB)
MIG = DeviceInfo("MIG-1", "A100-PCIE-40GB-MIG-3G.20GB", 19968 * MIB, is_mig=True)


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Periods are local time: pin the zone (and put it back)."""
    yield from _zone(monkeypatch, "UTC")


@pytest.fixture
def berlin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield from _zone(monkeypatch, "Europe/Berlin")


def _zone(monkeypatch: pytest.MonkeyPatch, zone: str) -> Iterator[None]:
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def at(text: str) -> float:
    """A local time (the zone the test pinned) as POSIX seconds."""
    import datetime as dt

    return dt.datetime.fromisoformat(text).timestamp()


def interval(
    memory_gib: float, hours: float = 1.0, devices: tuple[DeviceInfo | None, ...] = (A100,), start: float = T0, **kw: Any
) -> Interval:
    fields: dict[str, Any] = {"lease_id": "l-1", "owner": "alice", "groups": ("cs101",), "kernel_id": "k1"}
    fields.update(kw)
    return Interval(memory=int(memory_gib * GIB), start=start, end=start + hours * HOUR, devices=devices, **fields)


def only(rows: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(rows) == 1, rows
    return rows[0]


# --- GPU-hours ----------------------------------------------------------------------------------------
def test_a_slice_counts_its_share_of_the_gpu() -> None:
    row = only(report_rows([interval(8, hours=10)]))
    assert row["gpu_hours"] == pytest.approx(1.0)  # 8 of 80 GiB for 10 h
    assert row["gib_hours_held"] == pytest.approx(80.0)
    assert gpu_share(A100, 20 * GIB) == pytest.approx(0.25)


def test_a_whole_gpu_counts_one_even_when_overcommitted() -> None:
    assert only(report_rows([interval(80, hours=3)]))["gpu_hours"] == pytest.approx(3.0)
    assert only(report_rows([interval(120, hours=3)]))["gpu_hours"] == pytest.approx(3.0)  # 1.5x overcommit: still one GPU


def test_a_mig_instance_counts_whole_whatever_the_slice() -> None:
    row = only(report_rows([interval(4, hours=2, devices=(MIG,))]))
    assert row["gpu_hours"] == pytest.approx(2.0)
    assert row["gib_hours_held"] == pytest.approx(8.0)


def test_a_lease_on_several_gpus_counts_each() -> None:
    # 40 GiB on each of two 80 GiB GPUs (80 GiB in all) for 3 h: half of each GPU, 3 GPU-hours.
    row = only(report_rows([interval(80, hours=3, devices=(A100, A100_B))]))
    assert row["gpu_hours"] == pytest.approx(3.0)
    assert row["gib_hours_held"] == pytest.approx(240.0)
    whole = only(report_rows([interval(160, hours=3, devices=(A100, A100_B))]))
    assert whole["gpu_hours"] == pytest.approx(6.0)


def test_a_gpu_nothing_is_known_of_counts_whole() -> None:
    assert only(report_rows([interval(8, hours=2, devices=(None,))]))["gpu_hours"] == pytest.approx(2.0)


# --- periods ------------------------------------------------------------------------------------------
def test_a_lease_over_midnight_splits_its_hours_between_the_days(utc: None) -> None:
    item = interval(8, hours=6, start=at("2026-11-17 22:00"), active_seconds=3 * HOUR)
    rows = report_rows([item], by="user", period="day")
    assert [r["period"] for r in rows] == ["2026-11-17", "2026-11-18"]
    first, second = rows
    assert (first["gpu_hours"], second["gpu_hours"]) == (pytest.approx(0.2), pytest.approx(0.4))
    assert (first["gib_hours_held"], second["gib_hours_held"]) == (pytest.approx(16.0), pytest.approx(32.0))
    assert first["gib_hours_active"] + second["gib_hours_active"] == pytest.approx(24.0)
    assert first["leases"] == second["leases"] == 1
    # Without a period: one row over the whole range, no period field.
    whole = only(report_rows([item], by="user"))
    assert "period" not in whole and whole["gib_hours_held"] == pytest.approx(48.0)


def test_weeks_start_on_monday_and_months_on_the_first(utc: None) -> None:
    sunday_night = interval(8, hours=4, start=at("2026-11-22 22:00"))  # Sun 22:00 → Mon 02:00
    weeks = report_rows([sunday_night], period="week")
    assert [(r["period"], r["gib_hours_held"]) for r in weeks] == [("2026-11-16", 16.0), ("2026-11-23", 16.0)]
    new_year = interval(8, hours=48, start=at("2026-12-31 00:00"))
    months = report_rows([new_year], period="month")
    assert [(r["period"], r["gib_hours_held"]) for r in months] == [("2026-12-01", 192.0), ("2027-01-01", 192.0)]


def test_since_and_until_clip_the_periods(utc: None) -> None:
    item = interval(8, hours=48, start=at("2026-11-17 00:00"))
    rows = report_rows([item], period="day", since=at("2026-11-17 12:00"), until=at("2026-11-18 06:00"))
    assert [(r["period"], r["gib_hours_held"]) for r in rows] == [("2026-11-17", 96.0), ("2026-11-18", 48.0)]


def test_a_day_of_25_hours_when_summer_time_ends(berlin: None) -> None:
    item = interval(8, hours=25, start=at("2026-10-25 00:00"))  # clocks go back an hour that night
    assert [(r["period"], r["gib_hours_held"]) for r in report_rows([item], period="day")] == [("2026-10-25", 200.0)]


def test_rows_per_group_and_kernel_per_period(utc: None) -> None:
    items = [
        interval(8, hours=1, start=at("2026-11-17 09:00"), lease_id="l-1", groups=("cs101", "ml")),
        interval(8, hours=1, start=at("2026-11-18 09:00"), lease_id="l-2", groups=(), kernel_id=None),
    ]
    groups = report_rows(items, by="group", period="day")
    assert {(r["period"], r["group"]) for r in groups} == {("2026-11-17", "cs101"), ("2026-11-17", "ml"), ("2026-11-18", "(no group)")}
    kernels = report_rows(items, by="kernel", period="day")
    assert [r["kernel"] for r in kernels] == ["k1", "(lease l-2)"]
    with pytest.raises(InvalidInput, match="use one of none, day, week, month"):
        report_rows(items, period="fortnight")
    with pytest.raises(InvalidInput, match="use one of user, group, kernel"):
        report_rows(items, by="team")


# --- prices -------------------------------------------------------------------------------------------
def test_prices_by_model_most_specific_key_then_wildcard() -> None:
    prices = Prices({"A100-80GB": 2.5, "A100": 2.0, "A10": 0.8, "L4": 0.5, "*": 1.0})
    assert prices.gpu_hour_price("A100-SXM4-80GB") == 2.5  # both parts of A100-80GB are in the name
    assert prices.gpu_hour_price("A100-SXM4-40GB") == 2.0  # A100 prices the other size
    assert prices.gpu_hour_price("A10") == 0.8
    assert prices.gpu_hour_price("L40S") == 1.0  # L4 is not a part of L40S: the wildcard
    assert prices.gpu_hour_price("NVIDIA A100 80GB PCIe") == 2.5
    assert Prices({"RTX3090": 0.3}).gpu_hour_price("RTX-3090") == 0.3  # dashes aside, the same name
    assert Prices({"T4": 0.35}).gpu_hour_price("A100-SXM4-80GB") == 0.0  # no key, no wildcard: not charged


def test_cost_per_model_per_gib_hour_and_for_a_mig_instance() -> None:
    prices = Prices({"A100-80GB": 2.5, "A100-40GB-MIG-3g.20gb": 0.9, "*": 1.0}, per_gib_hour=0.01, currency="EUR")
    row = only(report_rows([interval(8, hours=10)], prices=prices))  # 1 GPU-hour of an A100-80GB, 80 GiB·h
    assert row["cost"] == pytest.approx(2.5 + 0.8) and row["currency"] == "EUR"
    mig = only(report_rows([interval(4, hours=2, devices=(MIG,))], prices=prices))  # priced by its own name
    assert mig["cost"] == pytest.approx(2 * 0.9 + 8 * 0.01)
    other = only(report_rows([interval(4, hours=2, devices=(DeviceInfo("GPU-t", "T4", 16 * GIB),))], prices=prices))
    assert other["cost"] == pytest.approx(0.5 * 1.0 + 8 * 0.01)  # the wildcard


def test_no_prices_no_cost_column() -> None:
    row = only(report_rows([interval(8)]))
    assert "cost" not in row and "currency" not in row
    assert columns("group", "week", priced=False) == ["period", "group", "leases", "gpu_hours", "gib_hours_held", "gib_hours_active", "gib_hours_burst", "gpu_hours_burst"]
    assert columns("user", "none", priced=True)[-2:] == ["cost", "currency"]
    assert "cost" in only(report_rows([interval(8)], prices=Prices(per_gib_hour=0.01)))  # GiB·hours alone are a price


def test_bad_prices_are_refused_by_the_policy() -> None:
    with pytest.raises(InvalidInput, match=r"price_per_gpu_hour\['A100'\] must be a price of 0 or more"):
        PoolPolicy(price_per_gpu_hour={"A100": -1})
    with pytest.raises(InvalidInput, match="must be a price"):
        PoolPolicy(price_per_gpu_hour={"A100": "cheap"})
    with pytest.raises(InvalidInput, match="price_per_gib_hour"):
        PoolPolicy(price_per_gib_hour=-0.5)


# --- through the pool: the ledger keeps what each GPU was --------------------------------------------
def test_the_ledger_records_the_gpus_so_a_report_survives_their_leaving(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, spec="2xA100-80GB", price_per_gpu_hour={"A100-80GB": 2.0})
    whole = pool.request(req("bob", gib=80, num_gpus=2, groups=("staff",)), now=T0)
    pool.release(whole.id, now=T0 + HOUR)
    part = pool.request(req("alice", gib=20, groups=("nlp",)), now=T0 + HOUR)
    pool.release(part.id, now=T0 + 3 * HOUR)
    pool.close()
    # The GPUs are gone (replaced by a T4): the report still knows they were 80 GiB A100s.
    later = make_pool(tmp_path, spec="1xT4", price_per_gpu_hour={"A100-80GB": 2.0, "*": 9.0})
    rows = {r["user"]: r for r in later.report(now=T0 + 4 * HOUR)}
    assert rows["alice"]["gpu_hours"] == pytest.approx(0.5)  # a quarter of an A100 for 2 h
    assert rows["bob"]["gpu_hours"] == pytest.approx(2.0)  # two whole A100s for 1 h
    assert rows["alice"]["cost"] == pytest.approx(1.0) and rows["bob"]["cost"] == pytest.approx(4.0)


def test_each_size_of_a_resized_lease_is_billed_for_its_own_time(tmp_path: Path) -> None:
    """Shrinking to almost nothing just before the release must not make the whole lease cheap."""
    pool = make_pool(tmp_path, spec="1x80GiB", price_per_gib_hour=0.01)
    lease = pool.request(req("alice", gib=40), now=T0)
    pool.resize(lease.id, memory=80 * GIB, now=T0 + HOUR)  # grown after 1 h
    pool.resize(lease.id, memory=1 * GIB, now=T0 + 3 * HOUR)  # shrunk after 2 more
    open_row = only(pool.report(now=T0 + 4 * HOUR))  # still held: metered up to now
    assert open_row["gib_hours_held"] == pytest.approx(40 + 160 + 1)
    pool.release(lease.id, now=T0 + 4 * HOUR)
    row = only(pool.report(now=T0 + 5 * HOUR))
    assert row["gib_hours_held"] == pytest.approx(40 + 160 + 1)
    assert row["gpu_hours"] == pytest.approx(0.5 + 2 + 1 / 80)
    assert row["cost"] == pytest.approx(2.01)
    assert pool.store.usage(T0 + 4 * HOUR, half_life=0)["alice"] == pytest.approx(201)  # fair share agrees
    assert only(pool.report(since=T0 + 2 * HOUR, now=T0 + 5 * HOUR))["gib_hours_held"] == pytest.approx(80 + 1)


def test_memory_segments() -> None:
    from jupyter_gpupool.core.metering import memory_segments

    assert memory_segments(0, 10, 4) == [(0, 10, 4)]
    assert memory_segments(0, 10, 4, [(3, 8), (6, 2)]) == [(0, 3, 8), (3, 6, 2), (6, 10, 4)]
    assert memory_segments(0, 10, 4, [(0, 8)]) == [(0, 10, 4)]  # resized the instant it was granted


def test_open_leases_are_metered_up_to_now(tmp_path: Path) -> None:
    pool = make_pool(tmp_path, spec="1x80GiB")
    pool.request(req("alice", gib=40), now=T0)
    row = only(pool.report(now=T0 + 4 * HOUR))
    assert row["gpu_hours"] == pytest.approx(2.0) and row["gib_hours_held"] == pytest.approx(160.0)


def test_ledger_rows_from_before_the_upgrade_take_their_gpus_from_the_inventory(tmp_path: Path) -> None:
    db = tmp_path / "old.sqlite"
    backend = SimulatedBackend.from_spec("1xA100-80GB")
    known = backend.devices()[0].uuid
    conn = sqlite3.connect(db)
    for script in MIGRATIONS[:2]:  # the schema before GPUs were recorded
        conn.executescript(script)
    conn.execute("PRAGMA user_version=2")
    row = "INSERT INTO ledger VALUES (?,?,?,?,?,?,?,?,?)"
    conn.execute(row, ("l-1", "alice", "[]", None, json.dumps([known]), 20 * GIB, T0, T0 + HOUR, 0.0))
    conn.execute(row, ("l-2", "bob", "[]", None, json.dumps(["GPU-long-gone"]), 20 * GIB, T0, T0 + HOUR, 0.0))
    conn.commit()
    conn.close()
    pool = Pool(backend, str(db), PoolPolicy(), clock=lambda: T0 + 2 * HOUR)
    rows = {r["user"]: r for r in pool.report()}
    assert rows["alice"]["gpu_hours"] == pytest.approx(0.25)  # its GPU is still here: 20 of 80 GiB
    assert rows["bob"]["gpu_hours"] == pytest.approx(1.0)  # unknown GPU: counts whole
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_mig_and_whole_gpu_leases_on_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An A100-40GB in MIG mode (3g.20gb + 2x 1g.5gb) and one without, as NVML reports them."""
    import fake_pynvml

    from jupyter_gpupool.devices.nvml import NvmlBackend

    fake_pynvml.FakeNvml(fake_pynvml.a100_mig()).install(monkeypatch)
    prices = {"A100-40GB": 2.0, "A100-40GB-MIG-3g.20gb": 1.0}
    pool = Pool(NvmlBackend(), str(tmp_path / "p.sqlite"), PoolPolicy(price_per_gpu_hour=prices), clock=lambda: T0)
    by_uuid = {d.uuid: d for d in pool.devices()}
    # 40 GiB fits only the GPU without MIG, then 19 GiB only the 3g.20gb, then 4 GiB a 1g.5gb.
    leases = [pool.request(req(name, gib=gib), now=T0) for name, gib in (("whole", 40), ("mig3g", 19), ("mig1g", 4))]
    for lease in leases:
        pool.release(lease.id, now=T0 + HOUR)
    rows = {r["user"]: r for r in pool.report(now=T0 + 2 * HOUR)}
    placed = {lease.owner: by_uuid[lease.devices[0]] for lease in leases}
    assert not placed["whole"].is_mig and placed["mig3g"].is_mig and placed["mig1g"].is_mig
    assert rows["whole"]["gpu_hours"] == pytest.approx(1.0) and rows["whole"]["cost"] == pytest.approx(2.0)
    assert rows["mig3g"]["gpu_hours"] == pytest.approx(1.0) and rows["mig3g"]["cost"] == pytest.approx(1.0)
    assert rows["mig1g"]["gpu_hours"] == pytest.approx(1.0) and rows["mig1g"]["cost"] == pytest.approx(2.0)  # as its GPU
    pool.close()


# --- the CLI --------------------------------------------------------------------------------------------
def cli(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite"), "TZ": "UTC", **env}
    return subprocess.run(["jupyter", "gpupool", *args], check=False, capture_output=True, text=True, env=environ, timeout=60)


@pytest.mark.parametrize(
    ("args", "accepted"),
    [
        (["--by", "team"], "use one of user, group, kernel"),
        (["--format", "xml"], "use one of table, csv, json"),
        (["--period", "fortnight"], "use one of none, day, week, month"),
    ],
)
def test_bad_report_choices_are_one_line_and_exit_2(tmp_path: Path, args: list[str], accepted: str) -> None:
    result = cli(["report", *args], tmp_path)
    assert result.returncode == 2, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and accepted in lines[0] and args[1] in lines[0], result.stderr
    assert "CRITICAL" not in result.stderr and "Traceback" not in result.stderr


def test_report_csv_and_json_shapes(tmp_path: Path) -> None:
    assert cli(["request", "4GiB", "--json"], tmp_path).returncode == 0
    plain = cli(["report", "--by", "user", "--period", "day", "--format", "csv"], tmp_path)
    assert plain.returncode == 0, plain.stderr
    header, *rows = list(csv.reader(io.StringIO(plain.stdout)))
    assert header == ["period", "user", "leases", "gpu_hours", "gib_hours_held", "gib_hours_active", "gib_hours_burst", "gpu_hours_burst"]  # no prices: no cost
    assert len(rows) == 1 and rows[0][2] == "1"
    priced = ["--PoolPolicy.price_per_gpu_hour={'*': 1.5}", "--PoolPolicy.currency=EUR"]
    data = json.loads(cli(["report", "--format", "json", "--period", "week", *priced], tmp_path).stdout)
    assert list(data[0]) == ["period", "user", "leases", "gpu_hours", "gib_hours_held", "gib_hours_active", "gib_hours_burst", "gpu_hours_burst", "cost", "currency"]
    assert data[0]["currency"] == "EUR" and data[0]["gpu_hours"] >= 0
    text = cli(["report", *priced], tmp_path).stdout
    assert "GPU·h" in text and "EUR" in text


def test_the_readme_report_sample_is_the_commands_output(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    shown = f"```bash\n{COMMAND}\n```\n\n```text\n"
    assert shown in readme, "the README shows the report command with its output below it"
    sample = readme.split(shown, 1)[1].split("```", 1)[0]
    result = run_readme_command(tmp_path)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0].split(",")
    assert {"gpu_hours", "gib_hours_held", "cost"} <= set(header) and header[:2] == ["period", "group"]
    assert result.stdout == sample, f"regenerate the README sample with `python tests/metering_sample.py`:\n{result.stdout}"


# --- the broker ----------------------------------------------------------------------------------------
def test_the_broker_reports_per_period_and_users_see_their_own_rows(tmp_path: Path) -> None:
    from broker_harness import BrokerHarness

    from jupyter_gpupool.core.models import LeaseRequest

    harness = BrokerHarness(tmp_path, policy={"price_per_gpu_hour": {"*": 2.0}}).start()
    try:
        harness.add_user("tok-alice", "alice", groups=("cs101",))
        harness.add_user("tok-prof", "prof", groups=("staff",), admin=True)
        alice, admin = harness.remote("tok-alice"), harness.remote("tok-prof")
        alice.release(alice.request(LeaseRequest(owner="", memory=4 * GIB)).id)
        admin.release(admin.request(LeaseRequest(owner="", memory=8 * GIB)).id)
        mine = alice.report(period="day")
        assert {r["user"] for r in mine} == {"alice"} and all("period" in r and "cost" in r for r in mine)
        assert {r["user"] for r in admin.report(period="month")} == {"alice", "prof"}
        with pytest.raises(InvalidInput, match="use one of none, day, week, month"):
            admin.report(period="year")
    finally:
        harness.stop()
