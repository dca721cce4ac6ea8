"""A kernel a real Jupyter Enterprise Gateway 3.x starts is pooled by the gateway host's pool.

Enterprise Gateway 3 needs ``jupyter_client<7`` and ``jupyter_server<2``, so it runs from an
environment of its own (pip-installed from the package index into the run's temporary folder); its kernelspec runs this environment's Python, whose
IPython config holds the pool's hook. The gateway is set up as docs/gateways.md says (its
Enterprise Gateway blocks are read and run here), with an admin who lets clients set
``GPUPOOL_DB`` and ``GPUPOOL_AUTOLEASE``: a start request that names another pool file, turns the
pool off and claims another user still gives a kernel leased from the gateway's pool, charged to
the gateway's Unix user, its GPU the lease's; a DELETE releases the lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envs import Environment, environment_of_its_own
from gateway_harness import KernelGateway, run_cell
from server_process import free_port, wait_for

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend

pytestmark = pytest.mark.slow

SPEC = "1x16GiB"
DOC = Path(__file__).resolve().parent.parent / "docs" / "gateways.md"
#: The Enterprise Gateway release the test installs (the newest 3.x).
EG_VERSION = "3.3.0"
#: What the gateway's clients may set, as an admin who allows too much would configure it.
CLIENT_NAMES = "GPUPOOL_DB,GPUPOOL_AUTOLEASE"
KERNEL_NAME = "gpupool-python"


def documented_blocks() -> list[str]:
    """The blocks of docs/gateways.md that this file runs (marked as run here), in order."""
    lines = DOC.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if "tests/test_enterprise_gateway.py runs" in line and lines[i + 1].startswith("```"):
            end = lines.index("```", i + 2)
            blocks.append("\n".join(lines[i + 2 : end]))
    assert len(blocks) == 2, "docs/gateways.md lost its Enterprise Gateway set-up or kernelspec"
    return blocks


def documented_gateway(pool_file: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """The gateway's environment and options as docs/gateways.md sets them up (its pool file
    ``pool_file``; the test picks the address)."""
    env: dict[str, str] = {}
    args: tuple[str, ...] | None = None
    for line in documented_blocks()[0].splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, _, value = word.partition("=")
                env[name] = str(pool_file) if name == "GPUPOOL_DB" else value
        elif len(words) > 1 and words[0].endswith("/jupyter") and words[1] == "enterprisegateway":
            args = tuple(w for w in words[2:] if not w.startswith(("--port=", "--ip=")))
    assert "EG_INHERITED_ENVS" in env and args is not None, "docs/gateways.md lost its Enterprise Gateway set-up"
    return env, args


def documented_kernelspec() -> dict[str, Any]:
    """The kernelspec docs/gateways.md gives, running this environment's Python."""
    spec = json.loads(documented_blocks()[1])
    assert spec["argv"][1:] == ["-m", "ipykernel_launcher", "-f", "{connection_file}"], spec
    spec["argv"][0] = sys.executable
    return spec


def enterprise_gateway_environment(root: Path) -> Environment:
    """Enterprise Gateway's environment, built under ``root`` (this run's temporary folder: a test
    writes nowhere else). A failed build fails the test with pip's words (an index out of reach
    included)."""
    try:
        return environment_of_its_own(root, [f"jupyter_enterprise_gateway=={EG_VERSION}"], pip_timeout=600)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        pytest.fail(f"Enterprise Gateway {EG_VERSION} could not be installed from the package index: {err}")


class EnterpriseGateway(KernelGateway):
    """``jupyter enterprisegateway`` from ``env`` on a free loopback port, its kernelspecs and
    runtime files under ``root``, with ``variables`` in its environment."""

    def __init__(self, env: Environment, root: Path, variables: dict[str, str], args: tuple[str, ...], start_timeout: float = 120) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kernels = root / "jupyter" / "kernels" / KERNEL_NAME
        kernels.mkdir(parents=True)
        spec = documented_kernelspec()
        if os.environ.get("PYTHONPATH"):  # a source checkout's package and the suite's guard, as every kernel here
            spec["env"] = {"PYTHONPATH": os.environ["PYTHONPATH"]}
        (kernels / "kernel.json").write_text(json.dumps(spec))
        environ = env.variables()
        for name in [n for n in environ if n.startswith(("GPUPOOL_", "EG_", "KG_", "JUPYTERHUB_"))]:
            del environ[name]
        environ.update(variables, JUPYTER_PATH=str(root / "jupyter"), JUPYTER_RUNTIME_DIR=str(root / "runtime"))
        argv = [str(env.bin / "jupyter"), "enterprisegateway", "--ip=127.0.0.1", f"--port={self.port}", "--port_retries=0", *args]
        self.serve(argv, environ, root, "Enterprise Gateway", start_timeout)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnterpriseGateway]:
    env = enterprise_gateway_environment(tmp_path_factory.mktemp("enterprise-gateway-env") / "venv")
    root = tmp_path_factory.mktemp("enterprise-gateway")
    variables, args = documented_gateway(root / "gateway-pool.sqlite")
    assert variables["GPUPOOL_SIMULATE"] == SPEC
    variables["EG_CLIENT_ENVS"] = CLIENT_NAMES  # an admin who allows too much: it must not count
    gw = EnterpriseGateway(env, root, variables, args)
    gw.pool_path = root / "gateway-pool.sqlite"  # type: ignore[attr-defined]
    yield gw
    gw.stop()


def live_leases(pool: Pool, kernel_id: str) -> list[Any]:
    return [lease for lease in pool.leases(kernel_id=kernel_id) if lease.live]


def test_a_client_cannot_choose_the_pool_opt_out_or_be_charged_as_another_user(gateway: EnterpriseGateway, tmp_path: Path) -> None:
    other = tmp_path / "client-pool.sqlite"
    model = gateway.call("POST", "api/kernels", {"name": KERNEL_NAME, "env": {
        "GPUPOOL_DB": str(other), "GPUPOOL_AUTOLEASE": "off", "KERNEL_USERNAME": "mallory"}}, timeout=120)
    kernel_id = model["id"]
    pool = Pool(SimulatedBackend.from_spec(SPEC), str(gateway.pool_path), PoolPolicy())  # type: ignore[attr-defined]
    try:
        lease = wait_for(lambda: (live_leases(pool, kernel_id) or [None])[0], 90, "the kernel's lease in the gateway's pool")
        assert lease.owner == pwd.getpwuid(os.getuid()).pw_name != "mallory", lease
        reply, shown = asyncio.run(run_cell(gateway.port, "", kernel_id, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])", 120))
        assert reply == "ok", shown
        devices = {d.uuid: d for d in pool.devices()}
        assert "".join(s for s in shown if not s.startswith("gpupool:")).strip() in {str(devices[u].index) for u in lease.devices} | set(lease.devices), (shown, lease)
        assert not other.exists()
        assert "ignored GPUPOOL_AUTOLEASE, GPUPOOL_DB from the Jupyter Enterprise Gateway's client" in gateway.log_path.read_text()

        gateway.call("DELETE", f"api/kernels/{kernel_id}", timeout=60)
        wait_for(lambda: not live_leases(pool, kernel_id), 15, "the lease released within 15 s of the DELETE")
        assert kernel_id not in gateway.kernel_ids()
    finally:
        pool.close()
