"""Quotas and guarantees: what an owner and their groups may hold, and whose guarantee covers a lease."""

from __future__ import annotations

from collections.abc import Iterable

from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.core.policy import PoolPolicy, Quota
from jupyter_gpupool.core.state import PoolState
from jupyter_gpupool.units import format_size


class Quotas:
    """The pool's quotas and guarantees, as one decision sees them."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy

    def limits(self, owner: str, groups: Iterable[str]) -> list[tuple[str, Quota]]:
        """(who, quota) pairs that limit this owner: their own, then each group's."""
        result = [("your", self.policy.quota_for_user(owner))]
        for group in groups:
            quota = self.policy.quota_for_group(group)
            if quota is not None:
                result.append((f"group {group}'s", quota))
        return result

    def holdings(self, state: PoolState, owner: str | None = None, group: str | None = None) -> tuple[int, int]:
        """(bytes held, number of live non-queued leases) for an owner or a group."""
        return state.derived().holdings(owner=owner, group=group)

    def block_reason(self, state: PoolState, lease: Lease) -> str:
        """Why quota keeps this queued lease waiting, or ``""``."""
        total = lease.memory * lease.num_gpus
        for who, quota in self.limits(lease.owner, lease.groups):
            if who == "your":
                held, count = self.holdings(state, owner=lease.owner)
            else:
                held, count = self.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + total > quota.maximum:
                return f"waits for {who} quota: {format_size(held)} of {format_size(quota.maximum)} in use"
            if quota.max_leases is not None and count >= quota.max_leases:
                return f"waits for {who} lease limit: {count} of {quota.max_leases} in use"
        return ""

    def guarantee_for(self, state: PoolState, lease: Lease, extra: int = 0) -> str:
        """Whose guarantee covers ``lease`` (``"your"``, ``"group staff's"``) with ``extra`` bytes more held, or ``""``.

        User and group guarantees combine as alternatives: a lease is within guarantee when what its
        owner holds fits in the owner's own guarantee, or what one of its groups' members hold
        together fits in that group's guarantee. A group's guarantee is shared by its members.
        """
        user_guarantee = self.policy.quota_for_user(lease.owner).guaranteed
        if user_guarantee > 0:
            held, _ = self.holdings(state, owner=lease.owner)
            if held + extra <= user_guarantee:
                return "your"
        for group in lease.groups:
            quota = self.policy.quota_for_group(group)
            if quota is not None and quota.guaranteed > 0:
                held, _ = self.holdings(state, group=group)
                if held + extra <= quota.guaranteed:
                    return f"group {group}'s"
        return ""

    def within_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """Whether a queued lease, once granted, stays within its owner's or one of its groups' guarantee."""
        return bool(self.guarantee_for(state, lease, extra=lease.memory * lease.num_gpus))

    def over_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """Whether a granted lease is covered by no guarantee (so a request within one may preempt it)."""
        return not self.guarantee_for(state, lease)
