"""Two weeks of a department's pool, for the README's `jupyter gpupool report` sample.

``fill(db)`` writes the history into a pool file through the real Pool (requests, activity,
releases at fixed times, UTC); ``python tests/metering_sample.py`` prints the README's sample
(the output of the README command run against such a pool, with the README's prices).
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Activity, LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB

#: The sample's GPUs (GPUPOOL_SIMULATE).
INVENTORY = "2xA100-80GB,2xT4"
#: The command the README shows.
COMMAND = "jupyter gpupool report --by group --period week --format csv"


def at(text: str) -> float:
    """``"2026-11-16 09:00"`` in UTC as POSIX seconds."""
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp()


#: (user, groups, GiB per GPU, GPUs, model, start, end, busy hours at the start)
HISTORY: list[tuple[str, tuple[str, ...], float, int, str | None, str, str, float]] = [
    # cs101's lab: 4 GiB slices of the T4s, Tuesday and Thursday mornings
    *[(f"student{i}", ("cs101",), 4, 1, "T4", f"2026-11-{day} 09:00", f"2026-11-{day} 11:00", 1.0) for day in (17, 19, 24, 26) for i in range(3)],
    # nlp: 40 GiB of an A100 through a working day, and a weekend run over the week's end
    ("ana", ("nlp",), 40, 1, "A100-80GB", "2026-11-16 09:00", "2026-11-16 17:00", 6.0),
    ("ana", ("nlp",), 40, 1, "A100-80GB", "2026-11-22 20:00", "2026-11-23 04:00", 8.0),
    ("raj", ("nlp",), 20, 1, "A100-80GB", "2026-11-25 10:00", "2026-11-25 14:00", 2.0),
    # staff: two whole A100s for a fine-tuning run
    ("prof", ("staff",), 80, 2, "A100-80GB", "2026-11-18 08:00", "2026-11-18 12:00", 4.0),
]


def fill(db: str) -> None:
    """Write :data:`HISTORY` into the pool file ``db``."""
    pool = Pool(SimulatedBackend.from_spec(INVENTORY), db, PoolPolicy(heartbeat_ttl=10**9), clock=lambda: at("2026-11-30 00:00"))
    events: list[tuple[float, int, str, int]] = []  # (time, order, what, index)
    for index, (_, _, _, _, _, start, end, busy) in enumerate(HISTORY):
        events += [(at(start), 1, "request", index), (at(start) + busy * 3600, 0, "idle", index), (at(end), 0, "release", index)]
    leases: dict[int, str] = {}
    for when, _, what, index in sorted(events):
        owner, groups, gib, gpus, model, *_ = HISTORY[index]
        if what == "request":
            lease = pool.request(LeaseRequest(owner=owner, memory=int(gib * GIB), groups=groups, num_gpus=gpus, model=model), now=when)
            assert lease.state.value == "granted", (owner, lease)
            leases[index] = lease.id
            pool.report_activity(lease.id, Activity(busy=True), now=when)
        elif what == "idle":
            pool.report_activity(leases[index], Activity(busy=False), now=when)
        else:
            pool.release(leases[index], now=when)
    pool.close()


def readme_config(readme: str) -> str:
    """The README's price settings (the python block that sets price_per_gpu_hour)."""
    for block in readme.split("```python")[1:]:
        code = block.split("```", 1)[0]
        if "price_per_gpu_hour" in code:
            return code
    raise AssertionError("the README shows no c.PoolPolicy.price_per_gpu_hour block")


def run_readme_command(folder: Path) -> subprocess.CompletedProcess[str]:
    """Fill a pool in ``folder``, put the README's prices in a config file there, run :data:`COMMAND`."""
    db = str(folder / "pool.sqlite")
    fill(db)
    config = folder / "config"
    config.mkdir()
    (config / "jupyter_gpupool_config.py").write_text(readme_config((REPO / "README.md").read_text()))
    env = {
        **os.environ,
        "GPUPOOL_DB": db,
        "GPUPOOL_SIMULATE": INVENTORY,
        "JUPYTER_CONFIG_DIR": str(config),
        "TZ": "UTC",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(COMMAND.split(), check=False, capture_output=True, text=True, env=env, timeout=120)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        result = run_readme_command(Path(tmp))
        sys.stderr.write(result.stderr)
        print(result.stdout, end="")
