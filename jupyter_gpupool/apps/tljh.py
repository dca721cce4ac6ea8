"""The Littlest JupyterHub plugin: one GPU pool for every student on the server.

Install into the hub environment with ``tljh install --plugin jupyter-gpupool`` (or
``sudo /opt/tljh/hub/bin/pip install jupyter-gpupool`` and ``sudo tljh-config reload hub``). The
plugin (entry point group ``tljh``) then

- runs the broker as a managed JupyterHub service ``gpupool`` on ``127.0.0.1:10101``, its store in
  ``/opt/tljh/state/gpupool/pool.sqlite``;
- declares the ``custom:gpupool:admin`` scope and grants it to TLJH's admin users (role
  ``gpupool-admin``; add teaching assistants to the hub group ``gpupool-admins``);
- lets every user reach the service (``access:services!service=gpupool`` in the ``user`` role) and
  puts that scope, and the admin scope for admins, into each server's token
  (``c.Spawner.server_token_scopes``);
- points every single-user server and kernel at the broker (``GPUPOOL_URL``) and installs the
  package into the users' environment;
- tells the broker that hub user ``NAME`` runs as Unix user ``jupyter-NAME``
  (``GPUPOOL_UNIX_USER_TEMPLATE``, i.e. ``c.Watchdog.unix_user_template``), so a lease counts
  exactly its user's processes.

Settings come from TLJH's ``config.yaml`` under ``gpupool:`` (``tljh-config set gpupool.default_memory 8GiB``):
``default_memory``, ``idle_timeout``, ``idle_policy``, ``simulate``, ``unix_user_template``, ``port``, ``db``. Quotas and
priorities per group go in ``/etc/jupyter/jupyter_gpupool_config.py`` (``c.PoolPolicy.group_quotas``),
which the broker reads at start.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import pluggy

from jupyter_gpupool.broker.auth import ADMIN_SCOPE
from jupyter_gpupool.wording import plural

hookimpl = pluggy.HookimplMarker("tljh")

SERVICE_NAME = "gpupool"
ACCESS_SCOPE = f"access:services!service={SERVICE_NAME}"
DEFAULT_PORT = 10101
DEFAULT_DB = "/opt/tljh/state/gpupool/pool.sqlite"
#: The scopes of JupyterHub's default ``server`` role, kept when we extend the server token.
SERVER_ROLE_SCOPES = ("users:activity!user", "access:servers!server")
#: config.yaml keys → broker environment variables.
ENV_SETTINGS = {
    "default_memory": "GPUPOOL_DEFAULT_MEMORY",
    "idle_timeout": "GPUPOOL_IDLE_TIMEOUT",
    "idle_policy": "GPUPOOL_IDLE_POLICY",
    "warning_period": "GPUPOOL_WARNING_PERIOD",
    "simulate": "GPUPOOL_SIMULATE",
    "unix_user_template": "GPUPOOL_UNIX_USER_TEMPLATE",
}
#: TLJH's Unix user of hub user ``{name}``: whose processes a lease of ``{name}`` may claim.
TLJH_UNIX_USERS = "jupyter-{name}"


def configure_hub(c: Any, settings: Mapping[str, Any] | None = None, python: str = sys.executable) -> None:
    """Add the broker service, scopes, roles and server environment to a JupyterHub config ``c``."""
    settings = dict(settings or {})
    unknown = set(settings) - set(ENV_SETTINGS) - {"port", "db"}
    if unknown:
        raise ValueError(
            f"unknown gpupool {plural(len(unknown), 'setting')} {sorted(unknown)}; use {', '.join(sorted([*ENV_SETTINGS, 'port', 'db']))}"
        )
    port = int(settings.get("port") or DEFAULT_PORT)
    db = str(settings.get("db") or DEFAULT_DB)
    url = f"http://127.0.0.1:{port}"

    scopes = dict(_value(c, "JupyterHub", "custom_scopes", {}))
    scopes.setdefault(
        ADMIN_SCOPE, {"description": "See every GPU lease with its user; release, resize or keep any of them."}
    )
    c.JupyterHub.custom_scopes = scopes

    environment = {"GPUPOOL_DB": db, "GPUPOOL_UNIX_USER_TEMPLATE": TLJH_UNIX_USERS}
    environment.update(
        {var: str(settings[key]) for key, var in ENV_SETTINGS.items() if settings.get(key) not in (None, "")}
    )
    services = [s for s in _value(c, "JupyterHub", "services", []) if s.get("name") != SERVICE_NAME]
    services.append(
        {
            "name": SERVICE_NAME,
            "url": url,
            "command": [python, "-m", "jupyter_gpupool.broker"],
            "environment": environment,
        }
    )
    c.JupyterHub.services = services

    roles = [r for r in _value(c, "JupyterHub", "load_roles", []) if r.get("name") not in ("gpupool-admin",)]
    user_role = next((r for r in roles if r.get("name") == "user"), None)
    if user_role is None:
        roles.append({"name": "user", "scopes": ["self", ACCESS_SCOPE]})
    elif ACCESS_SCOPE not in user_role.get("scopes", []):
        user_role["scopes"] = [*user_role.get("scopes", ["self"]), ACCESS_SCOPE]
    admins = sorted(_value(c, "Authenticator", "admin_users", set()))
    roles.append(
        {"name": "gpupool-admin", "scopes": [ADMIN_SCOPE, ACCESS_SCOPE], "users": admins, "groups": ["gpupool-admins"]}
    )
    c.JupyterHub.load_roles = roles
    groups = dict(_value(c, "JupyterHub", "load_groups", {}))
    groups.setdefault("gpupool-admins", {"users": []})
    c.JupyterHub.load_groups = groups

    token_scopes = _value(c, "Spawner", "server_token_scopes", [])
    current = (
        list(token_scopes) if isinstance(token_scopes, (list, tuple)) and token_scopes else list(SERVER_ROLE_SCOPES)
    )
    for scope in (ACCESS_SCOPE, ADMIN_SCOPE):  # the hub keeps only the scopes each user holds
        if scope not in current:
            current.append(scope)
    c.Spawner.server_token_scopes = current

    env = dict(_value(c, "Spawner", "environment", {}))
    env["GPUPOOL_URL"] = f"{url}/services/{SERVICE_NAME}"
    c.Spawner.environment = env


def _value(c: Any, section: str, name: str, default: Any) -> Any:
    """A value already in the config, else ``default`` (never traitlets' lazy placeholder)."""
    part = c.get(section, {})
    value = part.get(name)
    if value is None or type(value).__name__ == "LazyConfigValue":
        return default
    return value


def _tljh_settings() -> dict[str, Any]:
    """The ``gpupool:`` section of TLJH's config.yaml ({} outside TLJH)."""
    try:
        from tljh.config import CONFIG_FILE
        from tljh.yaml import yaml
    except ImportError:
        return {}
    try:
        with open(CONFIG_FILE) as f:
            data = yaml.load(f) or {}
    except FileNotFoundError:
        return {}
    section = data.get("gpupool") or {}
    return dict(section) if isinstance(section, Mapping) else {}


@hookimpl
def tljh_custom_jupyterhub_config(c: Any) -> None:
    """TLJH hook: configure the hub for the shared GPU pool."""
    configure_hub(c, _tljh_settings())


@hookimpl
def tljh_extra_user_pip_packages() -> list[str]:
    """Students' servers and kernels need the provisioner, server extension and magics."""
    return ["jupyter-gpupool"]


__all__ = ["configure_hub", "hookimpl", "tljh_custom_jupyterhub_config", "tljh_extra_user_pip_packages"]
