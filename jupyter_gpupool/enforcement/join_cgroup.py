"""``python -m jupyter_gpupool.enforcement.join_cgroup CGROUP -- CMD...``: join a cgroup, then run.

The kernel provisioner starts a kernel through this when MPS memory partitioning gives the kernel
a cgroup of its own (see :mod:`jupyter_gpupool.enforcement.partition`): the process moves itself
into the cgroup before the kernel's first CUDA call, then becomes the kernel (``exec``). If it
cannot join, it says so on stderr and runs anyway: the kernel's MPS hard limit and the watchdog
still hold it.
"""

from __future__ import annotations

import os
import sys


def join(cgroup: str) -> str:
    """Move this process into ``cgroup``; return an error clause, or ``""``."""
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w", encoding="ascii") as procs:
            procs.write(f"{os.getpid()}\n")
    except OSError as exc:
        return f"could not join {cgroup} ({exc.strerror or exc})"
    return ""


def exec_command(cmd: list[str]) -> int:
    """Become ``cmd`` (``exec``, searched on ``$PATH``); returns 127, after one line on stderr, only
    where it cannot be started. The launchers' last step (also :mod:`.device_join`'s)."""
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        sys.stderr.write(f"gpupool: could not start {cmd[0]}: {exc.strerror or exc}\n")
    return 127


def main(argv: list[str] | None = None) -> int:
    """Join the cgroup, then exec the command (returns only on a usage error or a failed exec)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[1] != "--":
        sys.stderr.write("usage: python -m jupyter_gpupool.enforcement.join_cgroup CGROUP -- COMMAND [ARGS...]\n")
        return 2
    cgroup, cmd = args[0], args[2:]
    problem = join(cgroup)
    if problem:
        sys.stderr.write(f"gpupool: {problem}; the kernel runs with its MPS hard limit only\n")
    return exec_command(cmd)


if __name__ == "__main__":
    sys.exit(main())
