"""Shared fixtures: a per-test pool file, a real jupyter_server with the gpupool extension and
strict auth, several users told apart by token, and helpers to run code in real kernels."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from traitlets import Dict
from traitlets.config import Config

REPO = Path(__file__).resolve().parent.parent

if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
# suite_guard: a private HOME and TMPDIR for the run, nothing written outside the sandbox; skips for
# want of a system package are counted. parallel_order: how the tests spread over pytest-xdist's workers.
pytest_plugins = ["pytest_jupyter.jupyter_server", "suite_guard", "parallel_order"]

# --- make a source checkout behave like an installed package ------------------------------------
# Kernels and `jupyter nbconvert` run in subprocesses: they need to import jupyter_gpupool and to
# find the `gpupool-provisioner` entry point. When the package is pip-installed both already hold.


def _ensure_importable() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *parts])


def _ensure_entry_point(where: Path) -> None:
    if entry_points(group="jupyter_client.kernel_provisioners", name="gpupool-provisioner"):
        return
    dist = where / "jupyter_gpupool_source_checkout-0.0.0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jupyter-gpupool-source-checkout\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text(
        "[jupyter_client.kernel_provisioners]\ngpupool-provisioner = jupyter_gpupool.provisioner:GpuPoolProvisioner\n"
    )
    sys.path.append(str(where))
    os.environ["PYTHONPATH"] = os.pathsep.join([*os.environ["PYTHONPATH"].split(os.pathsep), str(where)])


@pytest.fixture(scope="session", autouse=True)
def gpupool_importable(tmp_path_factory: pytest.TempPathFactory) -> None:
    """jupyter_gpupool and its provisioner entry point are visible here and in subprocesses."""
    _ensure_importable()
    _ensure_entry_point(tmp_path_factory.mktemp("entry-points"))


@pytest.fixture(scope="session", autouse=True)
def broker_file_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Brokers started by tests record themselves in a temporary file, never in /etc/jupyter (even
    where the shell running the tests names another file)."""
    folder = tmp_path_factory.mktemp("discovery")
    os.environ["GPUPOOL_BROKER_FILE"] = str(folder / "gpupool-broker.json")
    return folder


_tests_seen = iter(range(1, 1 << 62))


@pytest.fixture(autouse=True)
def broker_file_of_this_test(broker_file_in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test has a discovery file of its own, absent until a broker of that test writes it: servers,
    kernels and commands that choose no pool follow this host's discovery file, and one a broker of an
    earlier test left behind must not make them use that (long stopped) broker."""
    monkeypatch.setenv("GPUPOOL_BROKER_FILE", str(broker_file_in_tmp / f"test-{next(_tests_seen)}" / "gpupool-broker.json"))


@pytest.fixture(scope="session", autouse=True)
def simulator_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """What the simulator derives from the traces is kept in a temporary folder, not in ~/.cache."""
    os.environ["GPUPOOL_CACHE_DIR"] = str(tmp_path_factory.mktemp("gpupool-cache"))


@pytest.fixture(scope="session", autouse=True)
def ipython_dir_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Kernels started with this process's environment keep IPython's profile and history in a
    temporary folder, not in the real ~/.ipython."""
    os.environ["IPYTHONDIR"] = str(tmp_path_factory.mktemp("ipython"))


# --- the pool of one test -----------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    # A run started in the background by a shell without job control (``cmd &`` in a script, some
    # CI runners) ignores SIGINT, and every process the tests start would inherit that: a server
    # stopped with Ctrl-C, or a kernel the watchdog interrupts, would then only die of a later
    # signal. The tests check what SIGINT does, so their processes get its default.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "gpupool_env(**vars): GPUPOOL_* variables for this test's pool")
    config.addinivalue_line("markers", "gpupool_config(dict): extra server config merged into gpupool_server_config")


@pytest.fixture
def gpupool_env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fresh pool per test: ``1x16GiB`` simulated, 8 GiB default, owner ``alice``.

    Override with ``@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="2")``.
    """
    env = {
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DEFAULT_MEMORY": "8GiB",
        "GPUPOOL_USER": "alice",
    }
    marker = request.node.get_closest_marker("gpupool_env")
    if marker is not None:
        env.update({k: str(v) for k, v in marker.kwargs.items()})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("JUPYTER_DEFAULT_PROVISIONER_NAME", raising=False)
    return env


# --- users ------------------------------------------------------------------------------------------

#: token → user name. ``alice`` owns the server (GPUPOOL_USER); ``carol`` is a gpupool admin.
GPUPOOL_TOKENS = {"alice-token": "alice", "bob-token": "bob", "carol-token": "carol"}


def _identity_provider_class() -> type:
    from jupyter_server.auth.identity import IdentityProvider, User

    class TokenUsersIdentityProvider(IdentityProvider):
        """Tells users apart by their token, like JupyterHub does (for multi-user tests)."""

        users = Dict(config=True, help="token → user name")

        def get_user_token(self, handler: Any) -> User | None:  # type: ignore[override]
            token = self.get_token(handler)
            name = self.users.get(token) if token else None
            if name is None:
                return None
            handler._token_authenticated = True
            return User(username=name, name=name, display_name=name)

    return TokenUsersIdentityProvider


@pytest.fixture
def gpupool_tokens() -> dict[str, str]:
    """User name → the token that authenticates as that user on the test server."""
    return {name: token for token, name in GPUPOOL_TOKENS.items()}


@pytest.fixture
def gpupool_server_config(request: pytest.FixtureRequest, gpupool_env: dict[str, str]) -> Config:
    """Server config: the gpupool extension, no unauthenticated access, users by token, fast loops."""
    config = Config(
        {
            "ServerApp": {
                # jupyter_server_terminals has an undecorated websocket handler: strict auth refuses it.
                "jpserver_extensions": {"jupyter_gpupool": True, "jupyter_server_terminals": False},
                "allow_unauthenticated_access": False,
                "identity_provider_class": _identity_provider_class(),
            },
            "IdentityProvider": {"token": "alice-token", "users": dict(GPUPOOL_TOKENS)},
            "GpuPoolExtension": {"tick_interval": 0.25, "reconcile_interval": 0.25, "admin_users": ["carol"]},
            "Watchdog": {"interval": 0.5},
        }
    )
    marker = request.node.get_closest_marker("gpupool_config")
    if marker is not None:
        config.merge(Config(marker.args[0]))
    return config


@pytest.fixture
def jp_server_config(gpupool_server_config: Config) -> Config:
    return gpupool_server_config


@pytest.fixture
def gpupool_ext(jp_serverapp: Any) -> Any:
    """The running GpuPoolExtension of the test server."""
    return jp_serverapp.web_app.settings["gpupool"]


@pytest.fixture
def gpupool_fetch(jp_fetch: Any, gpupool_tokens: dict[str, str]) -> Callable[..., Awaitable[Any]]:
    """``await gpupool_fetch("api", "gpupool", "pool", user="bob", method="POST", body={...})``.

    Returns the tornado response without raising on HTTP errors; ``body`` dicts are sent as JSON.
    """

    async def fetch(*parts: str, user: str = "alice", body: Any = None, **kwargs: Any) -> Any:
        headers = dict(kwargs.pop("headers", {}) or {})
        headers["Authorization"] = f"token {gpupool_tokens[user]}"
        if body is not None and not isinstance(body, (str, bytes)):
            body = json.dumps(body)
        if body is not None:
            kwargs["body"] = body
        if kwargs.get("method") == "POST" and "body" not in kwargs:
            kwargs["body"] = "{}"
        return await jp_fetch(*parts, headers=headers, raise_error=False, **kwargs)

    return fetch


# --- kernels ----------------------------------------------------------------------------------------


async def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` (sync or async) until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what or predicate!r} (last: {last!r})")


@pytest.fixture
def gpupool_wait() -> Callable[..., Awaitable[Any]]:
    """``await gpupool_wait(lambda: ..., timeout=30, what="...")`` (see :func:`wait_until`)."""
    return wait_until


async def run_in_kernel(serverapp: Any, kernel_id: str, code: str, timeout: float = 60.0) -> str:
    """Run ``code`` in a server-managed kernel and return its stdout; fail on an error reply."""
    km = serverapp.kernel_manager.get_kernel(kernel_id)
    await asyncio.wait_for(asyncio.shield(km.ready), timeout)
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=timeout)
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"].get("traceback", [])) or msg["content"].get("evalue", ""))

        reply = await client.execute_interactive(code, output_hook=hook, timeout=timeout)
        if reply["content"]["status"] != "ok" or errors:
            raise AssertionError(f"kernel error running {code!r}: {''.join(errors) or reply['content']}")
        return "".join(out)
    finally:
        client.stop_channels()


@pytest.fixture
def kernel_exec(jp_serverapp: Any) -> Callable[..., Awaitable[str]]:
    """``out = await kernel_exec(kernel_id, "print(1)")``: stdout of code run in a real kernel."""

    async def run(kernel_id: str, code: str, timeout: float = 60.0) -> str:
        return await run_in_kernel(jp_serverapp, kernel_id, code, timeout)

    return run


@pytest.fixture
def arun(jp_asyncio_loop: asyncio.AbstractEventLoop) -> Callable[[Awaitable[Any]], Any]:
    """Run a coroutine on the test server's event loop: ``arun(scenario())``.

    Server tests are plain functions that call this, so they run on pytest-jupyter's loop (where
    the server lives) whatever pytest-asyncio's mode is; an ``async def`` test under
    ``asyncio_mode = "auto"`` would run on another loop and never get an answer from the server.
    """
    return jp_asyncio_loop.run_until_complete


@pytest.fixture(autouse=True)
def _fresh_provisioner_factory() -> Any:
    """Forget the process-wide KernelProvisionerFactory after each test.

    It is a singleton whose default provisioner is read from $JUPYTER_DEFAULT_PROVISIONER_NAME
    once, when first created: a test that sets the variable would otherwise route every later
    in-process kernel of the session through gpupool-provisioner.
    """
    yield
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    KernelProvisionerFactory.clear_instance()
