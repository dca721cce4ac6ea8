"""Whose is a kernel, and whose are its processes: the one claim rule of a multi-user host.

- **A kernel id is its owner's for the kernel's life.** The first user whose lease named a kernel
  id keeps it while that lease lives (granted, queued, suspended) and, once it is released, for
  as long as the kernel's process may still exist: while the lease's holder (its Jupyter server)
  runs on this host, and for :data:`RELEASED_CLAIM_SECONDS` after the release in any case. A lease
  of another user naming that id is refused (:func:`kernel_claim_refusal`); an admin may clear a
  stale claim (:func:`clear_kernel_claim`).
- **A pool user is a Unix user by configuration, not by guess.** :class:`UnixUsers` maps a pool
  user name to a uid: the same name by default, a template such as ``jupyter-{name}`` (The
  Littlest JupyterHub), or names given one by one. A process counts for a lease when it runs as
  the owner's uid. Where no uid maps, a process counts only when it descends from the lease's
  holder (the server that asked for it) on this host and runs as that holder's uid all the way
  down; never by its environment alone.
- **Root counts only as the kernel's launcher**: a root process counts for a lease only when it is
  the lease's holder or a root process that holder started.
- **A kernel keeps its GPU across a new lease.** The environment a kernel started with (what
  ``/proc/PID/environ`` shows) cannot name a lease it took later: :class:`KernelLeases` leads it
  to the live lease of the kernel it names (``GPUPOOL_KERNEL_ID``), or to the live successor of
  the earlier lease it names, for device control and unpooled attribution alike.
"""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.errors import GpuPoolError, LeaseNotFound, RequestRefused

#: Seconds a released lease's kernel id stays its owner's when its holder cannot be seen running
#: on this host (the kernel may outlive its server, or run on another host).
RELEASED_CLAIM_SECONDS = 3600.0

#: The ``pool_facts`` name under which an admin's clearing of a kernel id's claim is kept.
CLEARED_FACT = "kernel_claim_cleared:"


# --- pool user → Unix uid ---------------------------------------------------------------------------
@dataclass
class UnixUsers:
    """A pool user name → the Unix uid its processes run as, or None where none maps.

    ``template``: the Unix user name of pool user ``{name}`` (``"{name}"``: the same name;
    ``"jupyter-{name}"``: The Littlest JupyterHub). ``names``: a pool user → a Unix user name or a
    uid, before the template. ``""`` as the template maps nobody by name.
    """

    @classmethod
    def single_user(cls) -> UnixUsers:
        """The mapping of a watcher not told it serves many users (a single-user server, and the
        pool's own reads of what a lease holds): names by ``GPUPOOL_UNIX_USER_TEMPLATE`` (else the
        same name), and this process's own uid for a pool user no Unix user maps to (every lease of
        a one-user pool file is that user's, whatever name it carries)."""
        template = os.environ.get("GPUPOOL_UNIX_USER_TEMPLATE", "{name}")
        try:
            check_template(template)
        except ValueError:
            template = ""
        return cls(template=template, fallback_uid=os.getuid())

    template: str = "{name}"
    names: Mapping[str, str | int] = field(default_factory=dict)
    #: Whose processes a lease of a pool user no Unix user maps to may also claim (besides its
    #: own server's): the watcher's own uid on a single-user host; None on a multi-user one.
    fallback_uid: int | None = None
    #: Seconds before a pool user no Unix user mapped to is looked up again: a user added after the
    #: watcher started (a hub's new user, TLJH's ``jupyter-NAME`` made at first login) is found
    #: within this long of its first use, and each unmapped user costs one lookup per interval.
    miss_retry_seconds: float = 30.0
    _cache: dict[str, int | None] = field(default_factory=dict, repr=False)
    _missed: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def unix_name(self, owner: str) -> str | None:
        """The Unix user name (or uid, as text) ``owner``'s processes run as, before the lookup."""
        given = self.names.get(owner)
        if given is not None:
            return str(given)
        if not self.template:
            return None
        return self.template.replace("{name}", owner)

    def uid(self, owner: str) -> int | None:
        """``owner``'s Unix uid, or None when no Unix user maps (a hub-only user)."""
        if owner not in self._cache or (
            self._cache[owner] is None and time.monotonic() - self._missed.get(owner, 0.0) >= self.miss_retry_seconds
        ):
            self._cache[owner] = self._lookup(owner)
            if self._cache[owner] is None:
                self._missed[owner] = time.monotonic()
        return self._cache[owner]

    def _lookup(self, owner: str) -> int | None:
        name = self.unix_name(owner)
        if not name:
            return None
        if name.isdigit():
            return int(name)
        try:
            return pwd.getpwnam(name).pw_uid
        except (KeyError, ValueError):
            return None


def check_template(template: str) -> None:
    """A template names its pool user once as ``{name}`` (or is empty: no mapping by name)."""
    if template and template.count("{name}") != 1:
        raise ValueError(f"a Unix user template names the pool user once as {{name}}, as 'jupyter-{{name}}'; got {template!r}")


# --- which processes a lease may claim ----------------------------------------------------------------
def _uid(proc: psutil.Process, cache: dict[int, int | None]) -> int | None:
    if proc.pid not in cache:
        try:
            cache[proc.pid] = proc.uids().real
        except psutil.Error:
            cache[proc.pid] = None
    return cache[proc.pid]


def holder_here(lease: Lease, host: str) -> int | None:
    """The pid of ``lease``'s holder when it runs on ``host`` (the watcher's), else None."""
    if lease.holder_pid is None or (lease.holder_host and host and lease.holder_host != host):
        return None
    return int(lease.holder_pid)


def may_claim(chain: Sequence[psutil.Process], index: int, lease: Lease, users: UnixUsers, host: str,
              uids: dict[int, int | None] | None = None) -> bool:
    """Whether ``chain[index]`` (``chain``: a process and its ancestors, nearest first) may count
    as ``lease``'s: it runs as the owner's uid; or it is root and the lease's holder or a root
    process that holder started; or, where the owner maps to no uid, it runs as the mapping's
    fallback uid (a single-user host's own) or descends from the holder with every process from it
    up to the holder running as the holder's uid."""
    cache = uids if uids is not None else {}
    proc = chain[index]
    uid = _uid(proc, cache)
    if uid is None:
        return False
    expected = users.uid(lease.owner)
    if expected is not None:
        if uid == expected:
            return True
        if uid != 0:
            return False
    elif users.fallback_uid is not None and uid == users.fallback_uid:
        return True
    holder = holder_here(lease, host)
    if holder is None:
        return False
    for above in chain[index:]:
        if _uid(above, cache) != uid:
            return False  # a change of user on the way up: not the holder's own process
        if above.pid == holder:
            return True
    return False


# --- which live lease a process's start environment leads to ----------------------------------------------
#: The variable the pool's provisioner puts in every kernel's environment (with a lease or without).
KERNEL_ID_ENV = "GPUPOOL_KERNEL_ID"

#: Looks up leases no longer live by id (those an environment names); ids it does not know are left out.
EndedLookup = Callable[[set[str]], Mapping[str, Lease]]


class KernelLeases:
    """The live lease a process's start environment leads to, by the pool's one rule (device
    control and unpooled attribution both ask it; whether the process may count for that lease is
    :func:`may_claim`'s to say).

    In order: the live lease of the kernel it names (``GPUPOOL_KERNEL_ID``: a kernel has one
    lease); the live lease it names (``GPUPOOL_LEASE_ID``, or ``env_var``); else, for an earlier
    lease it names (``ended`` looks those up), that lease's live successor: the live lease of the
    same owner and kernel (a kernel that released its lease and reserved again), or of the same
    owner held by this very process when it held the earlier one (a kernel that leased for itself)."""

    def __init__(self, live: Iterable[Lease], host: str, ended: EndedLookup | None = None,
                 env_var: str = "GPUPOOL_LEASE_ID") -> None:
        self.live = {lease.id: lease for lease in live}
        self.env_var = env_var
        self._by_kernel = {lease.kernel_id: lease for lease in self.live.values() if lease.kernel_id}
        self._by_holder = {(lease.owner, lease.holder_pid): lease for lease in self.live.values()
                           if lease.holder_pid and holder_here(lease, host) is not None}
        self._ended_lookup = ended
        self._ended: dict[str, Lease | None] = {}

    def may_lead(self, environ: Mapping[str, str]) -> bool:
        """Whether ``environ`` may lead to a live lease (it names a lease, or a kernel that has one)."""
        return bool(environ.get(self.env_var)) or environ.get(KERNEL_ID_ENV, "") in self._by_kernel

    def look_up_ended(self, lease_ids: Iterable[str]) -> None:
        """Read the leases no longer live among ``lease_ids`` in one lookup (many processes, one read)."""
        unknown = {lease_id for lease_id in lease_ids if lease_id and lease_id not in self.live and lease_id not in self._ended}
        if not unknown:
            return
        found = dict(self._ended_lookup(unknown)) if self._ended_lookup is not None else {}
        for lease_id in unknown:
            self._ended[lease_id] = found.get(lease_id)

    def lease_of(self, pid: int, environ: Mapping[str, str]) -> Lease | None:
        """The live lease process ``pid``, started with ``environ``, leads to; None for none."""
        of_kernel = self._by_kernel.get(environ.get(KERNEL_ID_ENV, ""))
        if of_kernel is not None:
            return of_kernel
        lease_id = environ.get(self.env_var, "")
        if not lease_id:
            return None
        named = self.live.get(lease_id)
        if named is not None:
            return named
        self.look_up_ended((lease_id,))
        earlier = self._ended.get(lease_id)
        return self._successor(pid, earlier) if earlier is not None else None

    def _successor(self, pid: int, earlier: Lease) -> Lease | None:
        if earlier.kernel_id and earlier.kernel_id in self._by_kernel:
            successor = self._by_kernel[earlier.kernel_id]
            return successor if successor.owner == earlier.owner else None
        if earlier.holder_pid == pid:  # it held that lease itself, and holds a new one
            return self._by_holder.get((earlier.owner, pid))
        return None


class EndedLeases:
    """An :data:`EndedLookup` over a pool's ``get``, for a watcher that calls it on every pass: each
    lease read once (an ended lease's owner, kernel and holder never change), at most ``kept``."""

    def __init__(self, get: Callable[[str], Lease], kept: int = 4096) -> None:
        self._get = get
        self._kept = kept
        self._read: dict[str, Lease | None] = {}

    def __call__(self, lease_ids: set[str]) -> dict[str, Lease]:
        unknown = lease_ids - self._read.keys()
        if unknown and len(self._read) + len(unknown) > self._kept:
            self._read.clear()
            unknown = set(lease_ids)
        for lease_id in unknown:
            try:
                self._read[lease_id] = self._get(lease_id)
            except LeaseNotFound:
                self._read[lease_id] = None  # a made-up id: nobody's
            except GpuPoolError:
                continue  # the pool did not answer: asked again on the next pass
        return {lease_id: lease for lease_id in lease_ids if (lease := self._read.get(lease_id)) is not None}


# --- kernel ids -------------------------------------------------------------------------------------------
def claim_stands(lease: Lease, now: float, host: str, cleared_at: float | None = None,
                 released_seconds: float = RELEASED_CLAIM_SECONDS) -> bool:
    """Whether ``lease`` (the newest lease naming its kernel id) still holds that id for its owner."""
    if lease.live:
        return True
    released = lease.released_at if lease.released_at is not None else lease.created_at
    if cleared_at is not None and cleared_at >= released:
        return False
    if now - released < released_seconds:
        return True
    holder = holder_here(lease, host)
    return holder is not None and process_alive(holder)


def kernel_claim_refusal(pool: Any, kernel_id: str, owner: str, now: float | None = None, host: str = "",
                         released_seconds: float = RELEASED_CLAIM_SECONDS) -> str | None:
    """One line saying why ``owner`` may not name ``kernel_id`` in a lease, or None when they may."""
    lease: Lease | None = pool.last_lease_for_kernel(kernel_id)
    if lease is None or lease.owner == owner:
        return None
    now = time.time() if now is None else now
    cleared = pool.store.fact(CLEARED_FACT + kernel_id)
    cleared_at = float(cleared) if cleared else None
    if not claim_stands(lease, now, host, cleared_at, released_seconds):
        return None
    if lease.live:
        return f"kernel {kernel_id} already has a lease of another user; a kernel has one lease"
    return (
        f"kernel {kernel_id} belongs to another user, whose kernel process may still run; "
        "start a kernel of your own (a pool admin can clear a stale claim: jupyter gpupool clear-claim, "
        "or DELETE /api/gpupool/claims/<kernel id>)"
    )


def check_kernel_claim(pool: Any, kernel_id: str | None, owner: str, host: str = "",
                       released_seconds: float = RELEASED_CLAIM_SECONDS) -> None:
    """Raise :class:`RequestRefused` when ``owner`` may not name ``kernel_id`` in a lease."""
    if kernel_id:
        why = kernel_claim_refusal(pool, kernel_id, owner, pool.clock(), host, released_seconds)
        if why:
            raise RequestRefused(why)


def clear_kernel_claim(pool: Any, kernel_id: str, now: float | None = None, by: str = "") -> Lease | None:
    """An admin's act: ``kernel_id`` is nobody's from now until a lease names it again, written
    down as an event (``kind`` ``claim_cleared``, seen by the admins and the user it was cleared
    from). Returns the lease whose claim was cleared (None when no lease ever named the id). A live
    lease keeps its kernel: release it first."""
    lease: Lease | None = pool.last_lease_for_kernel(kernel_id)
    if lease is not None and lease.live:
        raise RequestRefused(f"kernel {kernel_id} has a live lease ({lease.id}); release it first")
    now = pool.clock() if now is None else now
    with pool.store.transaction():
        pool.store.remember(CLEARED_FACT + kernel_id, repr(float(now)))
    pool.store.record_event(now, "claim_cleared", lease.id if lease is not None else "", kernel_id,
                            lease.owner if lease is not None else "",
                            f"the claim on kernel {kernel_id} was cleared by {by or 'a pool admin'}")
    return lease


__all__ = [
    "CLEARED_FACT",
    "KERNEL_ID_ENV",
    "RELEASED_CLAIM_SECONDS",
    "EndedLeases",
    "EndedLookup",
    "KernelLeases",
    "UnixUsers",
    "check_kernel_claim",
    "check_template",
    "claim_stands",
    "clear_kernel_claim",
    "holder_here",
    "kernel_claim_refusal",
    "may_claim",
    "process_alive",
]
