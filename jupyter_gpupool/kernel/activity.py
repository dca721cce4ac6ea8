"""Report this kernel's own busy/idle state to the pool from inside the kernel.

A Jupyter server already reports activity for the kernels it runs; kernels started by
``jupyter nbconvert --execute``, nbclient, papermill or VS Code have no such server, so without
this a long autograding run would look idle and could lose its slice mid-run. The reporter
runs on a daemon thread and sends only changes (plus a heartbeat), so a cell costs two
attribute writes, not a database transaction.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from jupyter_gpupool.core.models import Activity


class ActivityReporter:
    """Marks busy on ``pre_run_cell`` and idle on ``post_run_cell``; a thread flushes to the pool."""

    def __init__(self, lease_id: Callable[[], str | None], pool: Callable[[], Any], interval: float = 2.0, heartbeat: float = 30.0) -> None:
        self._lease_id = lease_id
        self._pool = pool
        self.interval = interval
        self.heartbeat = heartbeat
        self.busy = False
        self.last_activity = time.time()
        self._reported: tuple[bool, float] | None = None
        self._reported_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    def pre_run_cell(self, *_: Any) -> None:
        self.busy = True
        self.last_activity = time.time()

    def post_run_cell(self, *_: Any) -> None:
        self.busy = False
        self.last_activity = time.time()

    def flush(self) -> bool:
        """Send the current state if it changed or a heartbeat is due; True when sent."""
        lease_id = self._lease_id()
        if not lease_id:
            return False
        state = (self.busy, self.last_activity)
        now = time.time()
        if state == self._reported and now - self._reported_at < self.heartbeat:
            return False
        try:
            self._pool().report_activity(lease_id, Activity(busy=self.busy, last_activity=self.last_activity))
        except Exception:  # noqa: BLE001 - the pool may be briefly locked or gone: try again next round, never break the kernel
            self.errors += 1
            return False
        self._reported, self._reported_at = state, now
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()

    def start(self, shell: Any) -> None:
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.events.register("post_run_cell", self.post_run_cell)
        self._thread = threading.Thread(target=self._run, name="gpupool-activity", daemon=True)
        self._thread.start()

    def stop(self, shell: Any) -> None:
        self._stop.set()
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                shell.events.unregister(name, callback)
            except ValueError:
                pass
