"""The pool file's guards against other processes: the lock that keeps a deleted file from being
forked into a second pool (:class:`PathGuard`), the processes that hold the file open
(:func:`other_holders`: a process of an earlier version is never left deciding on a schema it does
not know), and the one-line messages that say so."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct

#: What to tell an admin whose pool file is damaged or not ours.
RECOVER = (
    "stop every Jupyter server and broker using it, then restore the file from a backup, or move it away "
    "to start an empty pool (its leases are lost)"
)


class PathGuard:
    """A shared OFD lock on the pool file's folder, at an offset that stands for the file's name,
    held while a Store has the file open. Whoever finds the file missing asks the guard before
    creating a new pool there: a holder means the file was deleted or moved while in use, and a
    second pool on that path would grant the same memory again. (Folders survive a deleted file;
    OFD locks vanish with the process, so a SIGKILLed holder never blocks anyone.) Where the file
    system has no OFD locks the guard does nothing."""

    def __init__(self, path: str) -> None:
        self.directory = os.path.dirname(path)
        name = os.path.basename(path).encode()
        self.offset = int.from_bytes(hashlib.blake2b(name, digest_size=7).digest(), "big")
        self.fd: int | None = None

    def _lock(self, fd: int, cmd: int, kind: int) -> bytes:
        return fcntl.fcntl(fd, cmd, struct.pack("hhqqi", kind, os.SEEK_SET, self.offset, 1, 0))

    def hold(self) -> None:
        if not hasattr(fcntl, "F_OFD_SETLK"):
            return
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            self._lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK)
        except OSError:  # no OFD locks here (some network file systems)
            os.close(fd)
            return
        self.fd = fd

    def held_by_others(self) -> bool:
        """True if another open Store (in any process, this one included) holds this path."""
        if not hasattr(fcntl, "F_OFD_GETLK"):
            return False
        try:
            fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        try:
            reply = self._lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK)
        except OSError:
            return False
        finally:
            os.close(fd)
        return struct.unpack("hhqqi", reply)[0] != fcntl.F_UNLCK

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:  # a Store dropped without close() must not leak the folder's descriptor
        try:  # no contextlib here: at interpreter exit module globals may already be None
            self.release()
        except Exception:  # noqa: BLE001, S110 - nothing useful to do in a finalizer
            pass


def other_holders(path: str) -> list[tuple[int, str]]:
    """(pid, command line) of the other processes that hold the pool file (or its ``-wal`` or
    ``-shm``) open, read from ``/proc/*/fd`` (those of users this process may not inspect are not
    seen: a broker running as root sees every one)."""
    names = {os.path.realpath(path + suffix) for suffix in ("", "-wal", "-shm")}
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                fds = os.listdir(f"/proc/{entry}/fd")
                if any(_link(f"/proc/{entry}/fd/{fd}") in names for fd in fds):
                    found.append((int(entry), _command(int(entry))))
    return sorted(found)


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            # One line whatever the command holds (a `python -c` program, a name made to look like a log line).
            text = handle.read().replace(b"\0", b" ").decode(errors="replace")
            return " ".join("".join(ch if ch.isprintable() else " " for ch in text).split())[:120] or "?"
    except OSError:
        return "?"


def schema_changed(path: str, found: int, known: int) -> str:
    """Why a process stopped deciding on a pool file of another schema than its own."""
    return (
        f"the pool database {path} has schema {found}, but this jupyter-gpupool knows schema {known}: another "
        "version changed it while this process had it open, so this process stopped granting GPU memory; "
        "restart it with the jupyter-gpupool the others use"
    )


def held_while_migrating(path: str, found: int, known: int, holders: list[tuple[int, str]]) -> str:
    """Why a pool file of an earlier schema was not taken forward."""
    shown = "; ".join(f"pid {pid}: {command}" for pid, command in holders[:5])
    more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
    return (
        f"the pool database {path} has schema {found} and this jupyter-gpupool needs schema {known}, but "
        f"other processes have it open ({shown}{more}), which would go on deciding on a schema they do not "
        "know: stop them (or restart them with this version) first; the file was left unchanged"
    )


def hint(err: BaseException) -> str:
    """What to do about an SQLite error, for its one-line message."""
    text = str(err).lower()
    if "full" in text:
        return "free some disk space"
    if "malformed" in text or "not a database" in text or "corrupt" in text:
        return RECOVER
    if "readonly" in text or "read-only" in text or "unable to open" in text or "permission" in text:
        return "make the file and its folder writable by this user, or set GPUPOOL_DB to a writable path"
    if "locked" in text or "busy" in text:
        return "another process holds the pool's lock; try again"
    return "see the server's log"
