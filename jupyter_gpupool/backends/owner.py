"""Who asks: the user a lease is charged to, and the process that holds it."""

from __future__ import annotations

import getpass
import os
import socket


def default_owner() -> str:
    """The user leases are charged to when nobody says otherwise: $GPUPOOL_USER, the hub user, else the OS user."""
    return os.environ.get("GPUPOOL_USER") or os.environ.get("JUPYTERHUB_USER") or getpass.getuser()


def holder_identity() -> tuple[str, int]:
    """(host, pid) of this process: the holder of the leases it requests, reconciled if it dies."""
    return socket.gethostname(), os.getpid()


__all__ = ["default_owner", "holder_identity"]
