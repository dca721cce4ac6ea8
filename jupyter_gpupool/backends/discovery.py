"""How a shell on a broker host finds the host's broker without ``GPUPOOL_URL``.

A broker writes a small JSON file when it starts listening::

    {"url": "unix:///run/jupyter-gpupool/broker.sock", "urls": [...], "pid": 1234, "db": "...", "started": 1764...}

to ``$GPUPOOL_BROKER_FILE`` if set, else ``/etc/jupyter/gpupool-broker.json`` (when it may
write there, as a system service does), else ``{sys.prefix}/etc/jupyter/gpupool-broker.json``.
Every process that uses the pool reads the same places (environment first, then system) when none
of :data:`EXPLICIT_VARS` is set, and then talks to that broker as if ``GPUPOOL_URL`` named it:
``jupyter gpupool`` (application.py, apps/kernelspec.py), a server's pool and its provisioner's
(:func:`~jupyter_gpupool.backends.factory.pool_from_env`), and a kernel's client
(:func:`~jupyter_gpupool.kernel.client.connect`); the broker itself never does.
The file stays when the broker stops: the host is still configured for it, and a command must
say the broker is down rather than open a separate, empty pool. Delete it when the broker is
gone for good. ``GPUPOOL_BROKER_FILE=none`` turns discovery (reading and writing) off.

A command sends its token to the URL in that file, so a file is followed only when root, the
user running the command, or ``$GPUPOOL_BROKER_USER`` (the broker's service user) owns it and
every folder above it, and nobody else may write any of them (see :func:`distrust`); any other
is skipped with one line saying why.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jupyter_gpupool.errors import PoolUnavailable

FILE_NAME = "gpupool-broker.json"
ENV_VAR = "GPUPOOL_BROKER_FILE"
#: The user a broker service runs as, when not root: its discovery files are followed too.
USER_ENV_VAR = "GPUPOOL_BROKER_USER"
#: Largest discovery file read (a real one is a few hundred bytes).
MAX_FILE_BYTES = 64 * 1024
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


def trusted_uids(environ: Mapping[str, str] | None = None) -> set[int]:
    """Who may have written a discovery file this process follows: root, this process's user, and
    the broker's service user when ``$GPUPOOL_BROKER_USER`` names one (a user name or a uid)."""
    env = os.environ if environ is None else environ
    uids = {0, os.geteuid()}
    named = (env.get(USER_ENV_VAR) or "").strip()
    if named.isdigit():
        uids.add(int(named))
    elif named:
        try:
            import pwd

            uids.add(pwd.getpwnam(named).pw_uid)
        except (KeyError, ImportError):
            log.warning("%s=%s names no user of this host; only root's and your own broker files are followed", USER_ENV_VAR, named)
    return uids


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def distrust(path: str, info: os.stat_result, trusted: set[int]) -> str | None:
    """Why the discovery file ``path`` (``info``: its ``fstat``) must not be followed, or None.

    The file names the URL a command sends its token to (an admin's, from a root shell), so it
    counts only if written by someone trusted: the file is a regular file owned by a trusted user
    and writable by nobody else, and so is every folder above it (a shared folder with the sticky
    bit, such as /tmp, lets nobody replace what another user put there)."""
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid not in trusted:
        return f"it is owned by {_owner(info.st_uid)}, not by root or you"
    if info.st_mode & 0o022:
        return f"other users may write it (mode {stat.filemode(info.st_mode)})"
    folder = os.path.dirname(os.path.realpath(path))
    while True:
        try:
            folder_info = os.stat(folder)
        except OSError as err:
            return f"its folder {folder} cannot be checked ({err.strerror or err})"
        if folder_info.st_uid not in trusted:
            return f"its folder {folder} is owned by {_owner(folder_info.st_uid)}, not by root or you"
        if folder_info.st_mode & 0o022 and not folder_info.st_mode & stat.S_ISVTX:
            return f"other users may write its folder {folder} (mode {stat.filemode(folder_info.st_mode)})"
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _read_trusted(path: str, trusted: set[int]) -> tuple[Any, str | None]:
    """The JSON of the discovery file at ``path`` and None, or None and why it is not followed.
    Opened without blocking (a FIFO never stalls a command) and checked on the open file."""
    fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        why = distrust(path, os.fstat(fh.fileno()), trusted)
        if why is not None:
            return None, why
        raw = fh.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"more than {MAX_FILE_BYTES} bytes")
    return json.loads(raw), None


def find_broker(
    environ: Mapping[str, str] | None = None, on_ignored: Callable[[str], None] | None = None
) -> DiscoveredBroker | None:
    """The broker this host is configured for, unless the environment chooses a pool itself.

    A file that anyone but root, this user or ``$GPUPOOL_BROKER_USER`` could have written is
    skipped, with one line saying why passed to ``on_ignored`` (default: a warning in the log)."""
    env = os.environ if environ is None else environ
    if any((env.get(name) or "").strip() for name in EXPLICIT_VARS):
        return None
    trusted = trusted_uids(env)
    for path in candidate_paths(env):
        try:
            data, why = _read_trusted(path, trusted)
        except FileNotFoundError:
            continue
        except (OSError, ValueError, RecursionError) as err:
            raise PoolUnavailable(
                f"cannot read this host's broker file {path} ({getattr(err, 'strerror', None) or err}); "
                "fix or delete it, or set GPUPOOL_URL to the broker's address"
            ) from None
        if why is not None:
            message = (
                f"ignoring the broker file {path}: {why}; set GPUPOOL_URL to the broker's address, "
                f"or {USER_ENV_VAR} to the user it runs as"
            )
            (on_ignored or log.warning)(message)
            continue
        url = str(data.get("url") or "") if isinstance(data, dict) else ""
        if url:
            return DiscoveredBroker(url=url, path=path, data=data)
    return None


def broker_pool(found: DiscoveredBroker, environ: Mapping[str, str] | None = None) -> Any:
    """A :class:`~jupyter_gpupool.backends.remote.RemotePool` of the broker ``found`` names, as if
    ``GPUPOOL_URL`` were set to its URL (the token and timeouts still come from ``environ``); while
    it cannot be reached its message names the file it was found in."""
    from jupyter_gpupool.backends.remote import RemotePool  # on first use: a kernel starts without it

    env = os.environ if environ is None else environ
    pool = RemotePool.from_env({**env, "GPUPOOL_URL": found.url})
    pool.unreachable_hint = (
        f"set GPUPOOL_URL to where it runs now, or delete {found.path} (this host's broker file) if the host no longer has one"
    )
    return pool


__all__ = [
    "ENV_VAR",
    "FILE_NAME",
    "DiscoveredBroker",
    "broker_pool",
    "candidate_paths",
    "distrust",
    "find_broker",
    "listen_urls",
    "preferred_url",
    "trusted_uids",
    "write_discovery",
    "write_paths",
]
