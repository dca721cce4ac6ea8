"""``python -m jupyter_gpupool.enforcement.device_join [--timeout S] -- CMD...``: wait until the
pool has put this process in its kernel's device cgroup, then become the kernel.

Under device control a user's processes may not open a GPU node; a granted kernel's processes sit
in a root-owned cgroup that lets them open their GPUs (:mod:`.device_control`). A user's process
cannot move itself there: the pool (root) moves the kernel's processes it finds by the claim
rule. A kernel started through this waits for that move before it runs (``exec``), so its first
CUDA call never meets ``EPERM``. Waiting ends at ``--timeout`` seconds (default 10): the kernel then
runs anyway with one line on stderr saying its GPU may refuse to open until the pool catches up.

It needs no word on whether device control runs: it waits only while every GPU node refuses it
with ``EPERM`` (``/dev``, or a simulated pool's ``$GPUPOOL_SIMULATE_NODES``), so a launcher may start
every kernel through it. Without ``$GPUPOOL_LEASE_ID`` there is nothing to wait for.
"""

from __future__ import annotations

import os
import sys
import time

from jupyter_gpupool.enforcement.join_cgroup import exec_command

#: Seconds between two looks at ``/proc/self/cgroup`` (membership changes have no notification).
POLL_SECONDS = 0.02


def in_kernel_cgroup(lease_id: str, cgroup_file: str = "/proc/self/cgroup") -> bool:
    """Whether this process sits in lease ``lease_id``'s device cgroup (any hierarchy)."""
    suffix = f"-kernel-{lease_id}"
    try:
        with open(cgroup_file, encoding="utf-8") as handle:
            return any(line.rstrip("\n").endswith(suffix) for line in handle)
    except OSError:
        return False


def gpu_nodes_denied(node_dir: str) -> bool:
    """Whether every GPU node (``nvidiaN``) in ``node_dir`` refuses this process with ``EPERM``,
    as the users' deny of device control does; False where there are none, or one opens (or fails
    for another reason: a node with no driver behind it gives ``ENXIO``)."""
    try:
        names = [n for n in os.listdir(node_dir) if n.startswith("nvidia") and n[6:].isdigit()]
    except OSError:
        return False
    for name in names:
        try:
            os.close(os.open(os.path.join(node_dir, name), os.O_RDWR | os.O_CLOEXEC))
        except PermissionError:
            continue
        except OSError:
            return False
        return False
    return bool(names)


def wait_for_access(lease_id: str, timeout: float, node_dir: str) -> bool:
    """Wait until this process is in its kernel's cgroup, or no device control holds it (a GPU
    node opens); False when ``timeout`` seconds passed first."""
    deadline = time.monotonic() + timeout
    while not in_kernel_cgroup(lease_id) and gpu_nodes_denied(node_dir):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


def join_command(cmd: list[str], python: str, timeout: float | None = None) -> list[str]:
    """``cmd`` started through this launcher (with ``python``): it runs once its GPU opens to it."""
    wait = ["--timeout", f"{timeout:g}"] if timeout is not None else []
    return [python, "-m", "jupyter_gpupool.enforcement.device_join", *wait, "--", *cmd]


def main(argv: list[str] | None = None) -> int:
    """Wait, then exec the command (returns only on a usage error or a failed exec)."""
    args = sys.argv[1:] if argv is None else argv
    timeout = 10.0
    if args[:1] == ["--timeout"] and len(args) > 1:
        try:
            timeout = float(args[1])
        except ValueError:
            timeout = -1.0
        args = args[2:]
    if len(args) < 2 or args[0] != "--" or timeout < 0:
        sys.stderr.write("usage: python -m jupyter_gpupool.enforcement.device_join [--timeout SECONDS] -- COMMAND [ARGS...]\n")
        return 2
    lease_id = os.environ.get("GPUPOOL_LEASE_ID", "")
    node_dir = os.environ.get("GPUPOOL_SIMULATE_NODES") or "/dev"
    if lease_id and not wait_for_access(lease_id, timeout, node_dir):
        sys.stderr.write(
            f"gpupool: the pool did not set up this kernel's GPU access within {timeout:g} s; "
            "its GPU may refuse to open (EPERM) until it does\n"
        )
    return exec_command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
