"""The CLI line `jupyter gpupool demo` prints decides under the demo's policy, as its server does."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_the_printed_cli_line_decides_under_the_demo_policy(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUPOOL_")}
    demo = ["jupyter", "gpupool", "demo", "--dry-run", "--no-browser", f"--dir={tmp_path}", "--gpus=1x16GiB",
            "--idle-timeout=45s", "--warning-period=15s"]
    result = subprocess.run(demo, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    line = re.search(r"from another terminal: (.*) jupyter gpupool status$", result.stderr, re.MULTILINE)
    assert line, result.stderr
    # The same variables in front of any command: the pool it opens decides as the demo's server does.
    show = ("from jupyter_gpupool.backends.local.pool import Pool; pool = Pool.from_env(); "
            "print(pool.policy.idle_timeout, pool.policy.warning_period, pool.default_memory())")
    decided = subprocess.run(["bash", "-c", f"{line.group(1)} {sys.executable} -c '{show}'"], capture_output=True, text=True,
                             env=env, timeout=60, check=False)
    assert decided.returncode == 0, decided.stderr
    assert decided.stdout.split() == ["45.0", "15.0", str(4 * 1024**3)], decided.stdout
