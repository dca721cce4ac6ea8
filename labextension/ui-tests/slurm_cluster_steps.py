"""A real single-node Slurm cluster for the ``slurm`` browser suite (``run.sh slurm``).

``tests/slurm_cluster.py``'s :class:`SlurmCluster` (``munged``, ``slurmctld``, ``slurmd`` as root,
two stand-in GPUs with 16 GRES shards), started and stopped by one long-lived process so that
``run.sh`` can put JupyterLab on it and always stop it, even when the test fails:

    python slurm_cluster_steps.py check            # exit 0, or 1 with why no cluster can run here
    python slurm_cluster_steps.py serve ROOT       # start it in ROOT (a gpupool-slurm-* folder),
                                                   # write ROOT/cluster.env (SLURM_CONF=...) once the
                                                   # node is idle, stop everything on SIGTERM/SIGINT
    python slurm_cluster_steps.py reap             # SIGKILL what a killed ``serve`` left running

``serve`` owns the cluster (its pid is the cluster's ``owner.pid``) and stops it also when
``run.sh`` dies without running its trap; if ``serve`` itself is killed with SIGKILL, ``reap``
(which ``run.sh`` runs after stopping it) kills the daemons and job steps it left.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from slurm_cluster import SlurmCluster, reap_stale_clusters, skip_reason

ENV_FILE = "cluster.env"


def serve(root: Path) -> int:
    """Start a cluster in ``root``, announce it in ``root/cluster.env``, run until told to stop."""
    if "gpupool-slurm-" not in root.name:
        sys.exit(f"slurm_cluster_steps: {root} must be a folder named gpupool-slurm-* (its processes are found by it)")
    parent = os.getppid()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    cluster = SlurmCluster(root)
    try:
        try:
            cluster.start()
        except RuntimeError as error:  # says what timed out, with the daemons' logs
            print(f"slurm_cluster_steps: the cluster did not start: {error}", file=sys.stderr)
            return 1
        env = "".join(f"{name}={value}\n" for name, value in cluster.env.items())
        partial = root / f"{ENV_FILE}.partial"
        partial.write_text(env)
        partial.rename(root / ENV_FILE)  # whole or absent: run.sh waits for it
        print(f"slurm_cluster_steps: cluster up in {root} ({env.strip()})", flush=True)
        while not stop.wait(0.5):
            if os.getppid() != parent:  # run.sh was killed without its trap: stop with it
                print("slurm_cluster_steps: run.sh is gone; stopping the cluster", flush=True)
                break
    finally:
        cluster.stop()
    left = cluster.daemons_alive()
    if left:
        print(f"slurm_cluster_steps: still running after stop: {', '.join(left)}", file=sys.stderr)
        return 1
    print("slurm_cluster_steps: cluster stopped, nothing left running", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"]:
        reason = skip_reason()
        if reason:
            print(reason)
            return 1
        return 0
    if argv[:1] == ["serve"] and len(argv) == 2:
        return serve(Path(argv[1]).resolve())
    if argv[:1] == ["reap"]:
        killed = reap_stale_clusters()
        if killed:
            print(f"slurm_cluster_steps: killed leftover Slurm processes {killed}")
        return 0
    print("usage: slurm_cluster_steps.py check | serve ROOT | reap", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
