"""How a shell on a broker host finds the host's broker without ``GPUPOOL_URL``.

A broker writes a small JSON file when it starts listening::

    {"url": "unix:///run/jupyter-gpupool/broker.sock", "urls": [...], "pid": 1234, "db": "...", "started": 1764...}

to ``$GPUPOOL_BROKER_FILE`` if set, else ``/etc/jupyter/gpupool-broker.json`` (when it may
write there, as a system service does), else ``{sys.prefix}/etc/jupyter/gpupool-broker.json``.
``jupyter gpupool`` reads the same places (environment first, then system) when neither
``GPUPOOL_URL`` nor ``GPUPOOL_DB`` / ``GPUPOOL_SIMULATE`` is set, and then talks to that broker.
The file stays when the broker stops: the host is still configured for it, and a command must
say the broker is down rather than open a separate, empty pool. Delete it when the broker is
gone for good. ``GPUPOOL_BROKER_FILE=none`` turns discovery (reading and writing) off.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FILE_NAME = "gpupool-broker.json"
ENV_VAR = "GPUPOOL_BROKER_FILE"
SYSTEM_DIR = "/etc/jupyter"
#: Variables that choose a pool explicitly (GPUPOOL_BACKEND: another backend, e.g. Slurm); with any
#: of them set, discovery is not used.
EXPLICIT_VARS = ("GPUPOOL_URL", "GPUPOOL_DB", "GPUPOOL_SIMULATE", "GPUPOOL_BACKEND")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoveredBroker:
    """The broker a discovery file names."""

    url: str
    path: str  # the file it was read from
    data: dict[str, Any]


def _disabled(env: Mapping[str, str]) -> bool:
    return (env.get(ENV_VAR) or "").strip().lower() in {"none", "off", "0"}


def candidate_paths(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where a discovery file is looked for, in order (``$GPUPOOL_BROKER_FILE`` alone when set)."""
    env = os.environ if environ is None else environ
    if _disabled(env):
        return []
    explicit = (env.get(ENV_VAR) or "").strip()
    if explicit:
        return [os.path.abspath(explicit)]
    from jupyter_core.paths import ENV_CONFIG_PATH, SYSTEM_CONFIG_PATH

    dirs: list[str] = []
    for folder in [*ENV_CONFIG_PATH, *SYSTEM_CONFIG_PATH, SYSTEM_DIR]:
        if folder not in dirs:
            dirs.append(folder)
    return [os.path.join(d, FILE_NAME) for d in dirs]


def write_paths(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where a starting broker tries to write, in order: the first that works wins."""
    env = os.environ if environ is None else environ
    if _disabled(env):
        return []
    explicit = (env.get(ENV_VAR) or "").strip()
    if explicit:
        return [os.path.abspath(explicit)]
    return [os.path.join(SYSTEM_DIR, FILE_NAME), os.path.join(sys.prefix, "etc", "jupyter", FILE_NAME)]


def listen_urls(where: list[str]) -> list[str]:
    """Client URLs from the broker's listen lines ("http://IP:PORT/PREFIX (…)", "unix:/PATH (…)")."""
    urls = []
    for line in where:
        address = line.split(" ", 1)[0]
        if address.startswith("unix:"):
            urls.append("unix://" + "/" + address[len("unix:") :].lstrip("/"))
        else:
            for wildcard, local in (("//0.0.0.0:", "//127.0.0.1:"), ("//:::", "//[::1]:"), ("//[::]:", "//[::1]:")):
                address = address.replace(wildcard, local, 1)
            urls.append(address.rstrip("/"))
    return urls


def preferred_url(urls: list[str]) -> str:
    """A Unix socket first (a root shell is an admin there by its uid), else the first URL."""
    sockets = [u for u in urls if u.startswith("unix:")]
    return (sockets or urls)[0]


def write_discovery(urls: list[str], db: str = "", environ: Mapping[str, str] | None = None) -> str | None:
    """Record where this broker listens; returns the file written, or None (logged) when none could be."""
    if not urls:
        return None
    data = {"url": preferred_url(urls), "urls": urls, "pid": os.getpid(), "db": db, "started": time.time()}
    errors = []
    for path in write_paths(environ):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".gpupool-broker.", dir=os.path.dirname(path))
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=2)
                fh.write("\n")
            os.chmod(tmp, 0o644)  # every user's `jupyter gpupool` reads it
            os.replace(tmp, path)
            return path
        except OSError as err:
            errors.append(f"{path}: {err.strerror or err}")
    if errors:
        log.warning("could not record this broker for `jupyter gpupool` (%s); users set GPUPOOL_URL", "; ".join(errors))
    return None


def find_broker(environ: Mapping[str, str] | None = None) -> DiscoveredBroker | None:
    """The broker this host is configured for, unless the environment chooses a pool itself."""
    env = os.environ if environ is None else environ
    if any((env.get(name) or "").strip() for name in EXPLICIT_VARS):
        return None
    for path in candidate_paths(env):
        try:
            with open(path) as fh:
                data = json.load(fh)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as err:
            from .errors import PoolUnavailable

            raise PoolUnavailable(
                f"cannot read this host's broker file {path} ({getattr(err, 'strerror', None) or err}); "
                "fix or delete it, or set GPUPOOL_URL to the broker's address"
            ) from None
        url = str(data.get("url") or "") if isinstance(data, dict) else ""
        if url:
            return DiscoveredBroker(url=url, path=path, data=data)
    return None


__all__ = [
    "ENV_VAR",
    "FILE_NAME",
    "DiscoveredBroker",
    "candidate_paths",
    "find_broker",
    "listen_urls",
    "preferred_url",
    "write_discovery",
    "write_paths",
]
