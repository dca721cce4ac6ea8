"""Root ``conftest.py`` of jupyter_server's test tree in the *active* run: every server its tests
start loads the jupyter_gpupool server extension.

pytest-jupyter isolates the config paths, so the wheel's auto-enable file is never read there;
wrapping ``jp_configurable_serverapp`` reaches every server, including those of test modules that
replace ``jp_server_config`` with their own. A server without the extension loaded fails its
test, so an active run can never quietly run bare.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from traitlets.config import Config

EXTENSION = "jupyter_gpupool"


def _with_extension(config: Any) -> Config:
    """A copy of ``config`` whose ``ServerApp.jpserver_extensions`` enables the extension."""
    config = copy.deepcopy(Config(config))
    extensions = dict(config.ServerApp.get("jpserver_extensions", {}))
    extensions[EXTENSION] = True
    config.ServerApp.jpserver_extensions = extensions
    return config


def _check_loaded(app: Any) -> None:
    extension = app.extension_manager.extensions.get(EXTENSION)
    apps = app.extension_manager.extension_apps.get(EXTENSION, set())
    if extension is None or not extension.enabled or not apps:
        raise RuntimeError(f"the {EXTENSION} server extension did not load into this server (see its log above)")


@pytest.fixture
def jp_configurable_serverapp(jp_configurable_serverapp: Any, jp_server_config: Any) -> Any:
    """pytest-jupyter's server factory, with the extension enabled in whatever config it gets."""

    def start_with_extension(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_with_extension(args[0]), *args[1:])
        else:
            kwargs["config"] = _with_extension(kwargs.get("config", jp_server_config))
        app = jp_configurable_serverapp(*args, **kwargs)
        _check_loaded(app)
        return app

    return start_with_extension
