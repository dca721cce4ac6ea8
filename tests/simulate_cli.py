"""``jupyter gpupool simulate`` as a user runs it, in-process: its exit code and what it printed."""

from __future__ import annotations

import pytest

from jupyter_gpupool.apps.simulate import SimulateApp

#: A short lab on one 24 GiB GPU (six users, 0.1 day, each session needing 30% for 30 minutes): seconds to simulate.
SMALL_LAB = ["--gpus", "1x24GiB", "--users", "6", "--rate", "4", "--shape", "flat", "--days", "0.1",
             "--memory-need", "30%", "--session-length", "30m"]


def run_app(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the simulator with ``argv``: (exit code, stdout, stderr)."""
    app = SimulateApp()
    code = 0
    try:
        app.initialize(argv)
        app.start()
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
