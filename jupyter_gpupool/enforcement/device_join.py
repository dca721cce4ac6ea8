"""``python -m jupyter_gpupool.enforcement.device_join [--timeout S] -- CMD...``: wait until the
pool has put this process in its kernel's device cgroup, then become the kernel.

Under device control a user's processes may not open a GPU node; a granted kernel's processes sit
in a root-owned cgroup that lets them open their GPUs (:mod:`.device_control`). A user's process
cannot move itself there: the pool (root) moves the kernel's processes it finds by the claim
rule. A kernel started through this waits for that move before it runs (``exec``), so its first
CUDA call never meets ``EPERM``. Waiting ends at ``--timeout`` seconds (default 10): the kernel then
runs anyway with one line on stderr saying its GPU may refuse to open until the pool catches up.
Without ``$GPUPOOL_LEASE_ID`` there is nothing to wait for.
"""

from __future__ import annotations

import os
import sys
import time

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


def wait_for_cgroup(lease_id: str, timeout: float) -> bool:
    """Wait until :func:`in_kernel_cgroup`; False when ``timeout`` seconds passed first."""
    deadline = time.monotonic() + timeout
    while not in_kernel_cgroup(lease_id):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


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
    if lease_id and not wait_for_cgroup(lease_id, timeout):
        sys.stderr.write(
            f"gpupool: the pool did not set up this kernel's GPU access within {timeout:g} s; "
            "its GPU may refuse to open (EPERM) until it does\n"
        )
    cmd = args[1:]
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.stderr.write(f"gpupool: could not start {cmd[0]}: {exc.strerror or exc}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main())
