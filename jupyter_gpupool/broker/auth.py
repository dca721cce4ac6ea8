"""Who is asking the broker: JupyterHub tokens, or the peer credentials of a Unix socket.

The broker never trusts a user name sent in a request. Identity comes from

- :class:`HubIdentity`: the request's JupyterHub token (``Authorization: token ...`` or
  ``Bearer ...``) checked with the hub through :class:`jupyterhub.services.auth.HubAuth`. The
  hub's answer gives the user's name, groups (read at request time, cached a few seconds) and the
  token's scopes; the token must hold one of the service's access scopes
  (``access:services!service=gpupool``), and ``custom:gpupool:admin`` makes the caller an admin.
- :class:`PeerCredIdentity`: on a Unix socket, the kernel tells us the uid of the process at
  the other end (``SO_PEERCRED``); the uid's passwd entry and group list give name and groups.
  ``root`` and members of the configured admin groups are admins.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from tornado import web
from traitlets import Integer, Set, Unicode
from traitlets.config import LoggingConfigurable

from jupyter_gpupool.errors import PoolUnavailable

ADMIN_SCOPE = "custom:gpupool:admin"
METRICS_SCOPE = "read:metrics"
_TOKEN_HEADER = re.compile(r"^\s*(?:token|bearer)\s+(\S+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Identity:
    """The caller as the broker sees it."""

    name: str
    groups: tuple[str, ...] = ()
    admin: bool = False
    kind: str = "user"  # "user", "service" (hub service token) or "unix" (socket peer)
    scopes: frozenset[str] = field(default_factory=frozenset)
    uid: int | None = None
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "groups": list(self.groups), "admin": self.admin, "kind": self.kind}


class Unauthenticated(web.HTTPError):
    """401: no credentials, or credentials the hub does not know (forged, expired, revoked)."""

    def __init__(self, message: str) -> None:
        super().__init__(401, reason="Unauthorized")
        self.message = message


class Forbidden(web.HTTPError):
    """403: a known caller without the scope this broker requires."""

    def __init__(self, message: str) -> None:
        super().__init__(403, reason="Forbidden")
        self.message = message


def request_token(handler: web.RequestHandler) -> str | None:
    """The token of ``Authorization: token X`` / ``Bearer X`` (never from cookies or the URL)."""
    header = handler.request.headers.get("Authorization", "")
    match = _TOKEN_HEADER.match(header)
    return match.group(1) if match else None


def unix_peer(handler: web.RequestHandler) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the process at the other end of a Unix socket; None on TCP."""
    stream = getattr(handler.request.connection, "stream", None)
    sock = getattr(stream, "socket", None)
    if sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class HubIdentity(LoggingConfigurable):
    """Identify callers by their JupyterHub token (the broker runs as a hub service)."""

    api_url = Unicode(
        "",
        help="The hub's API URL, e.g. http://127.0.0.1:8081/hub/api/. Default: $JUPYTERHUB_API_URL "
        "(set by JupyterHub for a managed service).",
    ).tag(config=True)
    api_token = Unicode(
        "",
        help="The broker's own hub token, used to ask the hub who a token belongs to. "
        "Default: $JUPYTERHUB_API_TOKEN (set by JupyterHub for a managed service).",
    ).tag(config=True)
    access_scopes = Set(
        Unicode(),
        set(),
        help="A caller's token must hold one of these scopes. Default: $JUPYTERHUB_OAUTH_ACCESS_SCOPES, else "
        "access:services!service=$JUPYTERHUB_SERVICE_NAME (the scope JupyterHub gives for access to this service).",
    ).tag(config=True)
    admin_scope = Unicode(
        ADMIN_SCOPE,
        help="Holding this scope makes a caller a pool admin (sees every lease with its user; releases any). "
        "Declare it in c.JupyterHub.custom_scopes and grant it with a role.",
    ).tag(config=True)
    metrics_scopes = Set(
        Unicode(),
        {METRICS_SCOPE, ADMIN_SCOPE},
        help="A token holding any of these scopes may read /metrics (e.g. Prometheus' service token).",
    ).tag(config=True)
    cache_seconds = Integer(
        10,
        help="Seconds the hub's answer about a token is reused. Short, so group changes and revoked or "
        "expired tokens take effect quickly. 0: ask the hub on every request (HubAuth's own 0 would mean forever).",
    ).tag(config=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from jupyterhub.services.auth import HubAuth

        settings: dict[str, Any] = {"cache_max_age": max(1, self.cache_seconds)}
        if self.api_url:
            settings["api_url"] = self.api_url
        if self.api_token:
            settings["api_token"] = self.api_token
        if self.access_scopes:
            settings["access_scopes"] = set(self.access_scopes)
        self.hub_auth = HubAuth(parent=self, **settings)
        if not self.hub_auth.api_token:
            raise ValueError("no hub token: run the broker as a JupyterHub service or set HubIdentity.api_token")

    @property
    def enforced_access_scopes(self) -> set[str]:
        return set(self.hub_auth.access_scopes)

    async def model_for(self, handler: web.RequestHandler) -> dict[str, Any]:
        token = request_token(handler)
        if not token:
            raise Unauthenticated("no token: send 'Authorization: token <your JupyterHub API token>'")
        try:
            model = await self.hub_auth.user_for_token(token, use_cache=self.cache_seconds > 0, sync=False)
        except web.HTTPError as err:
            if err.status_code < 500:
                raise
            # The hub is down or restarting: a 503 that clients retry, never a bare 500.
            raise PoolUnavailable(
                f"the GPU pool broker cannot check tokens with JupyterHub right now ({err.log_message or err.reason}); "
                "retry in a moment"
            ) from None
        if not model:
            raise Unauthenticated("the hub does not know this token (forged, expired or revoked)")
        return model

    async def identify(self, handler: web.RequestHandler) -> Identity:
        """The caller of an API request; raises 401/403 HTTP errors."""
        model = await self.model_for(handler)
        scopes = set(model.get("scopes") or [])
        required = self.enforced_access_scopes
        if not required:
            raise Forbidden("the broker has no access scope configured; run it as a JupyterHub service")
        if not self.hub_auth.check_scopes(required, model):
            # Name the scope a role grants for this service (access:services!service=gpupool), not the bare one.
            needed = min(required, key=lambda scope: ("!service=" not in scope, scope))
            raise Forbidden(f"this token may not use the GPU pool: it needs the scope {needed}")
        admin = bool(self.hub_auth.check_scopes({self.admin_scope}, model))
        kind = str(model.get("kind") or "user")
        return Identity(
            name=owner_name(kind, str(model.get("name") or "")),
            groups=tuple(str(g) for g in model.get("groups") or ()),
            admin=admin,
            kind=kind,
            scopes=frozenset(scopes),
        )

    async def may_read_metrics(self, handler: web.RequestHandler) -> bool:
        model = await self.model_for(handler)
        return bool(self.hub_auth.check_scopes(set(self.metrics_scopes), model))


def owner_name(kind: str, name: str) -> str:
    """The pool's name for a hub identity: users and services never share a name.

    A user is their plain name; a service (or any other token kind) is ``KIND:NAME``; a user whose
    own name contains ``:`` is ``user:NAME``, so a user called ``service:grader`` is
    ``user:service:grader`` and can never act as the ``grader`` service. Names without ``:`` are
    users' (Unix user names, and so socket peers, never contain ``:``).
    """
    if kind == "user":
        return f"user:{name}" if ":" in name else name
    return f"{kind}:{name}"


class PeerCredIdentity(LoggingConfigurable):
    """Identify callers on a Unix socket by the uid of the connecting process (``SO_PEERCRED``)."""

    admin_users = Set(
        Unicode(),
        {"root"},
        help="Unix users who are pool admins when they connect over the socket.",
    ).tag(config=True)
    admin_groups = Set(
        Unicode(),
        {"gpupool-admin"},
        help="Members of these Unix groups are pool admins when they connect over the socket.",
    ).tag(config=True)
    metrics_groups = Set(
        Unicode(),
        set(),
        help="Members of these Unix groups may read /metrics over the socket (admins always may).",
    ).tag(config=True)

    def identify_peer(self, pid: int, uid: int, gid: int) -> Identity:
        """Who the peer is, from the user and group databases. Those are files: with no descriptor
        left a lookup fails as if the user or a group did not exist, so then the caller is asked
        to retry (503) instead of being refused or losing a group."""
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            _unless_out_of_descriptors()
            raise Forbidden(f"uid {uid} has no passwd entry; the pool serves only named Unix users") from None
        groups = tuple(sorted(_group_names(entry.pw_name, entry.pw_gid)))
        _unless_out_of_descriptors()
        admin = entry.pw_name in self.admin_users or uid == 0 or any(g in self.admin_groups for g in groups)
        return Identity(name=entry.pw_name, groups=groups, admin=admin, kind="unix", uid=uid, pid=pid)

    def may_read_metrics(self, identity: Identity) -> bool:
        return identity.admin or any(g in self.metrics_groups for g in identity.groups)


def _unless_out_of_descriptors() -> None:
    """Raise a retryable :class:`PoolUnavailable` if this process has no descriptor left now (a
    user or group lookup just made could not read its database)."""
    try:
        os.close(os.open(os.devnull, os.O_RDONLY))
    except OSError as err:
        if err.errno in (errno.EMFILE, errno.ENFILE):
            raise PoolUnavailable(
                "the GPU pool broker has no open files left to look up who you are; try again in a moment"
            ) from None


def _group_names(user: str, gid: int) -> set[str]:
    names: set[str] = set()
    try:
        gids = os.getgrouplist(user, gid)
    except OSError:
        gids = [gid]
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            continue
    return names


__all__ = [
    "ADMIN_SCOPE",
    "Forbidden",
    "HubIdentity",
    "Identity",
    "PeerCredIdentity",
    "Unauthenticated",
    "owner_name",
    "request_token",
    "unix_peer",
]
