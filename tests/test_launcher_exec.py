"""The two kernel launchers (``join_cgroup``, ``device_join``) end the same way: they become the
command, or, where it cannot be started, say so in one line on stderr and exit 127. Real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


@pytest.mark.parametrize("launcher", [["jupyter_gpupool.enforcement.join_cgroup", "/nonexistent-cgroup"], ["jupyter_gpupool.enforcement.device_join"]])
def test_a_launcher_whose_command_cannot_start_says_so_and_exits_127(launcher: list[str]) -> None:
    cmd = [sys.executable, "-m", *launcher, "--", "/nonexistent/kernel", "-f", "conn.json"]
    ran = subprocess.run(cmd, check=False, env=ENV, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 127, ran
    assert ran.stderr.splitlines()[-1] == "gpupool: could not start /nonexistent/kernel: No such file or directory", ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr
