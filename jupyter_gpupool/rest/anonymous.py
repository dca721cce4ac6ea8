"""What a caller who is not a pool admin may see of other users' use of the pool.

Views are built from allow-lists, never by blanking a list of known secrets: a field a lease gains
later is hidden from other users until it is added to :data:`OTHERS_FIELDS` here. Another user's
lease shows what it takes of the pool (size, GPUs, state, times), never who holds it or why: its
free text (reasons, notes) names processes, kernels and users, so it is blanked.

A caller's own lease keeps its free text, but decisions write the name of the user they served
into it ("moved to another GPU to make room for 16 GiB for bob", "(by admin carol)"): those names
are rewritten here (:func:`rewrite_text`) in every answer a non-admin gets (:func:`for_viewer`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jupyter_gpupool.core.models import Lease

#: Fields of another user's lease that a non-admin sees: what it takes of the pool and when, never
#: who holds it (owner, groups, ids, labels, pids, hosts) nor why (reasons and notes name users).
OTHERS_FIELDS = frozenset(
    {
        "state",
        "memory",
        "num_gpus",
        "compute_share",
        "model",
        "priority",
        "duration",
        "devices",
        "created_at",
        "granted_at",
        "transition",
        "suspendable",
        "resuming",
        "resume_ahead",
        "guarantee",
        "burst_limit",
        "parked_memory",
        "used_memory",
        "migrate_from",
        "home_devices",
        "reclaim_at",
        "queue_position",
        "mine",
    }
)

#: Free text the pool writes about a lease; it may name the user a decision served. Another
#: user's is blanked (it is not in :data:`OTHERS_FIELDS`); a caller's own is rewritten.
FREE_TEXT_FIELDS = ("release_reason", "reclaim_reason", "suspend_reason", "burst_note", "flagged")

#: Where the pool's decisions name a user: "... for 16 GiB for bob", "(12 GiB for bob)" (a move or a
#: preemption made room for bob's request), "(by admin carol)" (an admin released or suspended it) and
#: "(reported by admin carol)" (an admin reported a step failed).
_FOR_USER = re.compile(r"(?P<size>\d+(?:\.\d+)? (?:[KMGTPE]i?)?B) for (?P<who>.+?)(?=\)|$| \()")
_BY_ADMIN = re.compile(r"\((?P<how>(?:reported )?by) admin (?P<who>[^()]*)\)")
#: What stands for a user other than the viewer.
ANOTHER_USER = "another user"


def rewrite_text(text: str, viewer: str | None) -> str:
    """``text`` with every user a decision named, other than ``viewer``, rewritten as "another user"
    (an admin as "a pool admin")."""
    if " for " not in text and "by admin " not in text:
        return text  # the common case, without a regular expression

    def for_user(match: re.Match[str]) -> str:
        if match.group("who") in (viewer, ANOTHER_USER):
            return match.group(0)
        return f"{match.group('size')} for {ANOTHER_USER}"

    def by_admin(match: re.Match[str]) -> str:
        return match.group(0) if match.group("who") == viewer else f"({match.group('how')} a pool admin)"

    return _BY_ADMIN.sub(by_admin, _FOR_USER.sub(for_user, text))


def _hidden(value: Any) -> Any:
    """What a hidden field reads as: an empty list for a list (clients iterate it), else null."""
    return [] if isinstance(value, (list, tuple)) else None


def others_view(data: Mapping[str, Any]) -> dict[str, Any]:
    """Another user's lease (as JSON): every key kept, every value outside :data:`OTHERS_FIELDS` hidden."""
    return {key: value if key in OTHERS_FIELDS else _hidden(value) for key, value in data.items()}


def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
    """A lease as JSON for ``viewer``: in full for admins; the viewer's own with its free text
    rewritten (:func:`rewrite_text`); anyone else's through the allow-list (:func:`others_view`)."""
    data = lease.to_json()
    data["queue_position"] = position
    data["mine"] = viewer is not None and lease.owner == viewer
    if admin:
        return data
    if not data["mine"]:
        return others_view(data)
    for key in FREE_TEXT_FIELDS:
        if isinstance(data.get(key), str):
            data[key] = rewrite_text(data[key], viewer)
    return data


def for_viewer(answer: Any, viewer: str | None) -> Any:
    """A whole JSON answer for a non-admin ``viewer``: every text in it rewritten (:func:`rewrite_text`).
    The answer's leases must already be views (:func:`view_lease`); this catches the reasons that
    travel outside a lease (a decision's, a kernel's status, a queue reason). A ``label`` is the
    caller's own words and is left as written."""
    if isinstance(answer, str):
        return rewrite_text(answer, viewer)
    if isinstance(answer, dict):
        return {key: value if key == "label" else for_viewer(value, viewer) for key, value in answer.items()}
    if isinstance(answer, list):
        return [for_viewer(value, viewer) for value in answer]
    return answer


#: What a non-admin sees of device control: whether it runs and how, or why not; never which
#: cgroups hold users or how many kernels have one (what others run).
DEVICE_CONTROL_FIELDS = frozenset({"mode", "reason"})


def device_control_view(data: Mapping[str, Any], admin: bool) -> dict[str, Any]:
    """Device control's status (``device_control`` of the broker's info) as the caller may see it."""
    return dict(data) if admin else {key: value for key, value in data.items() if key in DEVICE_CONTROL_FIELDS}


__all__ = [
    "ANOTHER_USER",
    "DEVICE_CONTROL_FIELDS",
    "FREE_TEXT_FIELDS",
    "OTHERS_FIELDS",
    "device_control_view",
    "for_viewer",
    "others_view",
    "rewrite_text",
    "view_lease",
]
