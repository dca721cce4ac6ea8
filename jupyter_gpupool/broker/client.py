"""The kernel-side client of a broker: what ``%gpupool`` and the widget use when ``GPUPOOL_URL`` is set.

:func:`jupyter_gpupool.kernel.client.connect` imports :class:`HttpPoolClient` from here. It is the
in-process client's logic over a :class:`~jupyter_gpupool.remote.RemotePool`, so the magics behave
the same in both modes; identity comes from the kernel's hub token (``JUPYTERHUB_API_TOKEN``,
which kernels inherit from their single-user server) or its uid on the broker's socket.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from ..core.models import Lease
from ..kernel.client import InProcessPoolClient
from ..remote import API, RemotePool, _lease, _q


class HttpPoolClient(InProcessPoolClient):
    """This kernel's lease, through the broker at ``GPUPOOL_URL``."""

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, caps: Any = None) -> HttpPoolClient:
        source: MutableMapping[str, str] = os.environ if env is None else env
        return cls(env=source, pool_factory=lambda: RemotePool.from_env(source), caps=caps)

    def _pool_suspend(self, lease_id: str, reason: str) -> Lease:
        return remote_suspend(self.pool, lease_id, reason)

    def _pool_resume(self, lease_id: str) -> Lease:
        return remote_resume(self.pool, lease_id)


def remote_suspend(pool: RemotePool, lease_id: str, reason: str) -> Lease:
    """``POST .../leases/{id}/suspend``: the broker begins a suspend (409 with its reason when refused)."""
    return _lease(pool.call("POST", f"{API}/leases/{_q(lease_id)}/suspend", {"reason": reason}, idempotent=False))


def remote_resume(pool: RemotePool, lease_id: str) -> Lease:
    """``POST .../leases/{id}/resume``: queue a suspended lease to come back (harmless to repeat)."""
    return _lease(pool.call("POST", f"{API}/leases/{_q(lease_id)}/resume", {}))


__all__ = ["HttpPoolClient", "remote_resume", "remote_suspend"]
