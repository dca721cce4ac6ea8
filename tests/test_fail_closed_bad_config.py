"""An invalid setting fails closed: real ``jupyter server`` processes on a simulated pool, each
given one invalid value the way an admin would (a config file, the extension's own config file,
JSON, the command line), start a kernel over ``POST /api/kernels``; the kernel runs CPU-only
(``CUDA_VISIBLE_DEVICES=""``) or, with ``refuse``, ends dead with the reason; the log says once,
in one line and without a traceback, which setting is wrong and what it accepts; and
``GET /api/gpupool/pool`` says ``unavailable`` with that reason.

On the code before these tests: ``c.EnforcementSettings.framework_caps = "maybe"`` stopped the
extension from loading and the kernel started unpooled with every GPU (fail open); a bad value in
``jupyter_gpupool_config.py`` made the server exit; ``c.GpuPoolExtension.when_unavailable = "bogus"``
and a bad ``c.Watchdog.action`` were dropped with a traceback and the kernel got a slice as if
nothing were wrong (with the watchdog never started, and every other ``c.GpuPoolExtension``
setting dropped too); ``retry_interval = -3`` was accepted; a bad ``c.PoolPolicy`` value did fail
closed, but the reason was traitlets' sentence, not the setting to fix.
"""

from __future__ import annotations

import json
import time
import urllib.error
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient
from server_process import Server, wait_for
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.enforcement.watchdog import Watchdog
from jupyter_gpupool.serverextension.app import GpuPoolExtension
from jupyter_gpupool.serverextension.configguard import (
    ConfigProblem,
    InvalidConfig,
    drop_invalid,
    reason_for,
    server_configurables,
)

ENV_CODE = "import os, json; print(json.dumps(dict(os.environ)))"
UNAVAILABLE_LINE = "gpupool: the GPU pool is unavailable: invalid configuration: "


# --- real servers ---------------------------------------------------------------------------------


def start_server(tmp_path: Path, files: dict[str, str], args: tuple[str, ...] = ()) -> Server:
    """A `jupyter server` (the gpupool extension on, a simulated 1xA100-80GB pool) with ``files``
    written into its Jupyter config folder before it starts."""
    config_dir = tmp_path / "admin" / "config"
    config_dir.mkdir(parents=True)
    settings = {"ServerApp": {"jpserver_extensions": {"jupyter_gpupool": True, "jupyter_server_terminals": False}}}
    for name, text in files.items():
        if name == "jupyter_server_config.json":  # the admin's JSON settings, beside the extension's switch
            settings.update(json.loads(text))
        else:
            (config_dir / name).write_text(text)
    (config_dir / "jupyter_server_config.json").write_text(json.dumps(settings))
    env: dict[str, str | None] = {
        "GPUPOOL_SIMULATE": "1xA100-80GB",
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_USER": "admin",
        "GPUPOOL_WHEN_UNAVAILABLE": None,
        "GPUPOOL_URL": None,
        "GPUPOOL_BACKEND": None,
        "JUPYTER_DEFAULT_PROVISIONER_NAME": None,
    }
    return Server(tmp_path, "admin", env, args)


def kernel_env(server: Server, kernel_id: str, timeout: float = 60.0) -> dict[str, str]:
    """The environment of the server's kernel, read by running code in it."""
    connection = server.root / "runtime" / f"kernel-{kernel_id}.json"
    wait_for(
        lambda: connection.exists() and connection.stat().st_size > 0, timeout, f"kernel {kernel_id}'s connection file"
    )
    client = BlockingKernelClient(connection_file=str(connection))
    client.load_connection_file()
    client.start_channels()
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.wait_for_ready(timeout=10)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, f"kernel {kernel_id} never answered"
        out: list[str] = []
        reply = client.execute_interactive(
            ENV_CODE,
            timeout=timeout,
            output_hook=lambda m: out.append(m["content"].get("text", "")) if m["msg_type"] == "stream" else None,
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        return json.loads("".join(out))
    finally:
        client.stop_channels()


def assert_told_once(server: Server, setting: str, accepted: str) -> None:
    """The log names the setting and what it accepts in one warning line, once, and loading the
    extension logged no traceback (call it before a refused start: jupyter_client logs one then)."""
    log = server.log_path.read_text()
    lines = [line for line in log.splitlines() if UNAVAILABLE_LINE in line]
    assert len(lines) == 1, log[-4000:]
    assert setting in lines[0] and accepted in lines[0] and "restart the server" in lines[0], lines[0]
    assert "Traceback" not in log and "error linking" not in log and "failed loading" not in log, log[-4000:]
    assert "failed starting" not in log and "Bad config" not in log, log[-4000:]


CPU_ONLY_CASES = {
    # name: (config files, command-line arguments, the setting as the reason names it, what it accepts)
    "extension enum": (
        {"jupyter_server_config.py": 'c.GpuPoolExtension.when_unavailable = "bogus"\n'},
        (),
        "c.GpuPoolExtension.when_unavailable = 'bogus'",
        "must be one of 'cpu-only', 'refuse'",
    ),
    "negative interval": (
        {"jupyter_server_config.py": "c.GpuPoolExtension.retry_interval = -3\n"},
        (),
        "c.GpuPoolExtension.retry_interval = -3",
        "must be more than 0 seconds",
    ),
    "extension's own config file": (
        {"jupyter_gpupool_config.py": 'c.GpuPoolExtension.tick_interval = "5s"\n'},
        (),
        "c.GpuPoolExtension.tick_interval = '5s'",
        "expected a float",
    ),
    "enforcement in JSON": (
        {"jupyter_server_config.json": json.dumps({"EnforcementSettings": {"framework_caps": "maybe"}})},
        (),
        "c.EnforcementSettings.framework_caps = 'maybe'",
        "expected a boolean",
    ),
    "policy on the command line": (
        {},
        ("--PoolPolicy.idle_timeout=x",),
        "c.PoolPolicy.idle_timeout = 'x'",
        "expected a float",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CPU_ONLY_CASES))
def test_an_invalid_setting_starts_kernels_cpu_only_and_says_which(case: str, tmp_path: Path) -> None:
    files, args, setting, accepted = CPU_ONLY_CASES[case]
    server = start_server(tmp_path, files, args)
    try:
        pool = server.call("GET", "api/gpupool/pool")
        assert pool["state"] == "unavailable" and pool["no_gpu"] is False and pool["devices"] == [], pool
        assert setting in pool["reason"] and accepted in pool["reason"], pool["reason"]
        kernel = server.call("POST", "api/kernels", {"name": "python3"})
        env = kernel_env(server, kernel["id"])
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void", env.get(
            "CUDA_VISIBLE_DEVICES"
        )
        assert "GPUPOOL_LEASE_ID" not in env and setting in env["GPUPOOL_UNAVAILABLE"]
        status = server.call("GET", f"api/gpupool/kernels/{kernel['id']}")
        assert status["state"] == "unavailable" and setting in status["reason"], status
        assert_told_once(server, setting, accepted)
    finally:
        server.stop()


@pytest.mark.slow
def test_refuse_is_kept_while_another_setting_is_invalid_and_the_start_is_refused(tmp_path: Path) -> None:
    """A valid ``refuse`` beside an invalid ``c.Watchdog.action``: the valid one is kept, so the
    start is refused with the reason (before, the watchdog silently never started and the kernel
    got a slice)."""
    config = 'c.GpuPoolExtension.when_unavailable = "refuse"\nc.Watchdog.action = "kill"\n'
    server = start_server(tmp_path, {"jupyter_server_config.py": config})
    setting, accepted = "c.Watchdog.action = 'kill'", "must be one of 'warn', 'interrupt', 'stop'"
    try:
        pool = server.call("GET", "api/gpupool/pool")
        assert pool["state"] == "unavailable" and pool["when_unavailable"] == "refuse", pool
        assert setting in pool["reason"] and accepted in pool["reason"], pool["reason"]
        assert_told_once(server, setting, accepted)
        with pytest.raises(urllib.error.HTTPError) as refused:
            server.call("POST", "api/kernels", {"name": "python3"})
        assert refused.value.code == 503, refused.value
        message = json.loads(refused.value.read())["message"]
        assert setting in message, message
        assert server.call("GET", "api/kernels") == []  # never launched, nothing left behind
        assert server.log_path.read_text().count(UNAVAILABLE_LINE) == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_the_same_server_with_valid_settings_grants_a_slice(tmp_path: Path) -> None:
    """The control: valid settings of the same classes, the same way, and the kernel gets its slice."""
    files = {
        "jupyter_server_config.py": 'c.GpuPoolExtension.when_unavailable = "refuse"\nc.GpuPoolExtension.retry_interval = 5\n'
        'c.Watchdog.action = "warn"\nc.EnforcementSettings.framework_caps = True\n',
        "jupyter_gpupool_config.py": "c.GpuPoolExtension.tick_interval = 2\n",
    }
    server = start_server(tmp_path, files, ("--PoolPolicy.idle_timeout=600",))
    try:
        pool = server.call("GET", "api/gpupool/pool")
        assert pool["state"] == "available" and pool["when_unavailable"] == "refuse", pool
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        env = kernel_env(server, kernel_id)
        status = server.call("GET", f"api/gpupool/kernels/{kernel_id}")
        assert status["state"] == "granted" and env["CUDA_VISIBLE_DEVICES"] == status["devices"][0]["uuid"], status
        log = server.log_path.read_text()
        assert "invalid configuration" not in log and "Traceback" not in log, log[-3000:]
    finally:
        server.stop()


# --- the guard itself -------------------------------------------------------------------------------


def test_outside_a_server_an_invalid_value_still_raises() -> None:
    """Config checkers (tests/test_doc_examples.py) build the extension from config: that stays strict."""
    with pytest.raises(TraitError, match="when_unavailable"):
        GpuPoolExtension(config=Config({"GpuPoolExtension": {"when_unavailable": "bogus"}}))
    with pytest.raises(TraitError, match="more than 0 seconds"):
        GpuPoolExtension(config=Config({"GpuPoolExtension": {"reconcile_interval": 0}}))
    assert GpuPoolExtension(config=Config({"GpuPoolExtension": {"retry_interval": 0.3}})).retry_interval == 0.3


def test_linked_to_a_server_each_value_loads_on_its_own() -> None:
    """Once linked, an invalid value keeps its default and is recorded; the valid ones beside it
    (an ``append`` too) still apply, where traitlets would have rolled them all back."""
    extension = GpuPoolExtension()
    extension._tolerate_invalid_config = True
    config = Config()
    config.GpuPoolExtension.when_unavailable = "refuse"
    config.GpuPoolExtension.retry_interval = "soon"
    config.GpuPoolExtension.admin_users.append("carol")
    config.GpuPoolExtension.tick_interval = -1
    extension.update_config(config)
    assert extension.when_unavailable == "refuse" and extension.admin_users == ["carol"]
    assert extension.retry_interval == 30.0 and extension.tick_interval == 5.0
    assert [(p.trait, p.value) for p in extension.config_problems] == [
        ("retry_interval", "'soon'"),
        ("tick_interval", "-1"),
    ]
    extension.update_config(Config())  # loading again does not repeat them
    assert len(extension.config_problems) == 2
    with pytest.raises(InvalidConfig, match=r"c\.GpuPoolExtension\.retry_interval = 'soon' \(expected a float"):
        extension.raise_for_invalid_config()


def test_drop_invalid_removes_only_invalid_values_and_names_them() -> None:
    server_config = Config(
        {
            "PoolPolicy": {"idle_timeout": "x", "overcommit": 9.0, "default_memory": "8GiB"},
            "Watchdog": {"action": "warn", "grace": -1.0},
            "ServerApp": {"port": 1},
        }
    )
    extension_config = Config({"PoolPolicy": {"idle_timeout": "x"}})
    problems = drop_invalid([server_config, extension_config], [PoolPolicy, Watchdog])
    assert [(p.section, p.trait) for p in problems] == [
        ("PoolPolicy", "idle_timeout"),
        ("PoolPolicy", "overcommit"),
        ("Watchdog", "grace"),
    ]
    assert problems[0].accepted == "expected a float, not the str 'x'"
    assert "between 1.0 and 4.0" in problems[1].accepted and "less than 0.0" in problems[2].accepted
    assert dict(server_config.PoolPolicy) == {"default_memory": "8GiB"} and dict(server_config.Watchdog) == {
        "action": "warn"
    }
    assert dict(extension_config.PoolPolicy) == {} and server_config.ServerApp.port == 1
    PoolPolicy(config=server_config).validate_all()  # what is left builds
    Watchdog(config=server_config)


def test_the_reason_is_one_bounded_line() -> None:
    problems = [ConfigProblem("PoolPolicy", f"t{i}", repr("v" * 200), "expected a float") for i in range(5)]
    reason = reason_for(problems)
    assert "\n" not in reason and reason.count("c.PoolPolicy.") == 3 and "and 2 more" in reason
    assert str(InvalidConfig(reason)) == reason and InvalidConfig.http_status == 503


def test_every_class_a_server_reads_is_checked() -> None:
    names = {cls.__name__ for cls in server_configurables()}
    assert {
        "PoolPolicy",
        "GpuPoolProvisioner",
        "EnforcementSettings",
        "Watchdog",
        "GpuPool",
        "SlurmPool",
        "GpuPoolExtension",
    } <= names
    assert not {"Broker", "HubIdentity"} & names
