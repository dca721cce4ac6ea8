"""Reservations and users' preferences of a local pool, each booked, cancelled or saved in a
transaction of its own (see :class:`~jupyter_gpupool.backends.local.pool.Pool`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jupyter_gpupool.core.policy import Reservation, parse_reservation
from jupyter_gpupool.core.validate import preferences as validate_preferences
from jupyter_gpupool.errors import LeaseNotFound

if TYPE_CHECKING:
    from jupyter_gpupool.backends.local.pool import Pool


class PoolBookings:
    """Books and cancels reservations and saves preferences for the pool it is part of."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Reservation:
        """Hold capacity for users or groups (see :attr:`PoolPolicy.reservations` for the forms)."""
        now = self.pool._now(now)
        reservation = parse_reservation(spec, now=now)
        self.pool.engine.check_reservation(self.pool.devices(), reservation, now, self.pool.reservations())  # never one the pool cannot honour
        stored = dict(spec)
        if reservation.start is not None:
            stored.update(start=reservation.start, end=reservation.end)
            stored.pop("duration", None)
        with self.pool.store.transaction():
            self.pool.store.put_reservation(reservation.name, stored)
        return reservation

    def cancel_reservation(self, name: str) -> None:
        with self.pool.store.transaction():
            if not self.pool.store.delete_reservation(name):
                raise LeaseNotFound(f"no reservation named {name!r}")

    def set_preference(self, owner: str, values: dict[str, Any]) -> None:
        """Save ``owner``'s defaults; a value not in its accepted form is an InvalidInput, saving nothing."""
        values = validate_preferences(values, self.pool.policy.max_gpus_per_lease)
        with self.pool.store.transaction():
            current = self.pool.store.preference(owner)
            current.update(values)
            self.pool.store.set_preference(owner, current)
