"""The pool view's memory used outside the pool, as openapi.yaml and openapi-broker.yaml document it:
the real server's and the real broker's ``GET .../pool`` answers validate against the specs, every
field of an unpooled item is documented, whose it is shows only to admins and to its own user, and
the server's ``unpooled`` event is one the lease v2 schema accepts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.enforcement.unpooled import UnpooledUse
from jupyter_gpupool.serverextension.app import LEASE_SCHEMA_ID
from jupyter_gpupool.units import GIB

REPO = Path(__file__).resolve().parent.parent
#: Fields of an unpooled item that say whose it is (null unless admin or the viewer's own).
WHOSE = ("pid", "user", "command", "host", "lease_id")


def json_schema(spec_file: str, schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` of an OpenAPI 3.0 spec as JSON Schema: ``nullable`` as a null type, 3.0's boolean
    ``exclusiveMinimum``, and the spec's components under ``$defs``."""
    spec = yaml.safe_load((REPO / spec_file).read_text())

    def convert(node: Any) -> Any:
        if isinstance(node, list):
            return [convert(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: convert(value) for key, value in node.items() if key not in ("nullable", "example")}
        if "$ref" in out:
            out["$ref"] = out["$ref"].replace("#/components/schemas/", "#/$defs/")
        if out.get("exclusiveMinimum") is True:
            out["exclusiveMinimum"] = out.pop("minimum")
        if node.get("nullable"):
            if "type" in out:
                out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        return out

    return {**convert(schema), "$defs": convert(spec["components"]["schemas"])}


def spec_schemas(spec_file: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / spec_file).read_text())["components"]["schemas"]


def uses(uuid: str) -> list[UnpooledUse]:
    """Alice's training run without a lease, and bob's kernel whose lease is suspended."""
    return [
        UnpooledUse(device=uuid, pid=4242, bytes=2 * GIB, host=HOSTNAME, why="no lease", user="alice",
                    command="python train.py --epochs 3", stoppable=True, since=1.0),
        UnpooledUse(device=uuid, pid=5151, bytes=3 * GIB, host=HOSTNAME, why="its lease is suspended", user="bob",
                    command="python -m ipykernel_launcher", lease_id="lease-b", since=2.0),
    ]


def check_unpooled_view(view: dict[str, Any], viewer: str, admin: bool, spec_file: str) -> None:
    """Memory held outside the pool is shown to everyone; whose, to admins and its own user."""
    documented = set(spec_schemas(spec_file)["UnpooledUse"]["properties"])
    owner = {2 * GIB: ("alice", 4242, "no lease"), 3 * GIB: ("bob", 5151, "its lease is suspended")}
    assert sorted(item["bytes"] for item in view["unpooled"]) == sorted(owner)
    assert view["devices"][0]["memory_unpooled"] == 5 * GIB
    for item in view["unpooled"]:
        assert set(item) == documented, f"{spec_file} documents {sorted(documented)}, the server sends {sorted(item)}"
        user, pid, why = owner[item["bytes"]]
        assert item["mine"] == (user == viewer)
        assert item["why"] == why  # that the memory is taken, and why, everyone sees
        if admin or user == viewer:
            assert (item["pid"], item["user"], item["host"]) == (pid, user, HOSTNAME) and item["command"]
        else:
            assert all(item[key] is None for key in WHOSE), item


# --- the server extension ---------------------------------------------------------------------------
def test_the_servers_pool_view_with_memory_outside_the_pool_is_as_openapi_yaml_says(arun, gpupool_fetch, gpupool_ext):
    pool: Pool = gpupool_ext.pool
    uuid = pool.devices()[0].uuid
    # Another watcher's sighting (the server's own watchdog replaces only its own).
    pool.report_unpooled(uses(uuid), reporter="elsewhere:1", ttl=3600)
    spec = yaml.safe_load((REPO / "openapi.yaml").read_text())
    schema = json_schema("openapi.yaml", spec["components"]["schemas"]["Pool"])
    device_fields = set(spec["components"]["schemas"]["PoolDevice"]["properties"])

    async def scenario() -> None:
        for user, admin in (("alice", False), ("bob", False), ("carol", True)):
            response = await gpupool_fetch("api", "gpupool", "pool", user=user)
            assert response.code == 200, response.body
            view = json.loads(response.body)
            jsonschema.validate(view, schema)
            assert "memory_unpooled" in device_fields and "memory_unpooled" in view["devices"][0]
            check_unpooled_view(view, user, admin, "openapi.yaml")

    arun(scenario())


def test_the_unpooled_event_is_valid_for_the_lease_v2_schema_and_says_no_whose(arun, jp_serverapp, gpupool_ext):
    events: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=LEASE_SCHEMA_ID, listener=listener)
    assert LEASE_SCHEMA_ID == "https://events.jupyter.org/jupyter_gpupool/lease/v2"
    assert LEASE_SCHEMA_ID in (REPO / "openapi.yaml").read_text()

    async def scenario() -> None:
        gpupool_ext.emit_unpooled(3 * GIB, "GPU-sim-0")  # the emit is validated against lease-v2.yaml
        for _ in range(100):
            if events:
                return
            await asyncio.sleep(0.02)

    arun(scenario())
    assert len(events) == 1, "the unpooled event did not validate against the lease v2 schema"
    event = events[0]
    assert (event["action"], event["lease_id"], event["kernel_id"], event["state"], event["memory"]) == (
        "unpooled", None, None, None, 3 * GIB)
    assert "GPU-sim-0" in event["message"] and "outside the pool" in event["message"]


# --- the broker -------------------------------------------------------------------------------------
@pytest.fixture
def broker(tmp_path):
    from broker_harness import BrokerHarness

    harness = BrokerHarness(tmp_path).start()
    harness.add_user("tok-alice", "alice")
    harness.add_user("tok-bob", "bob")
    harness.add_user("tok-admin", "root", admin=True)
    try:
        yield harness
    finally:
        harness.stop()


def test_the_brokers_pool_view_with_memory_outside_the_pool_is_as_openapi_broker_yaml_says(broker):
    uuid = broker.on_broker(lambda: broker.pool.devices()[0].uuid)
    broker.on_broker(lambda: broker.pool.report_unpooled(uses(uuid), reporter="elsewhere:1", ttl=3600))
    spec = yaml.safe_load((REPO / "openapi-broker.yaml").read_text())
    answer = spec["paths"]["/api/gpupool/pool"]["get"]["responses"]["200"]
    schema = json_schema("openapi-broker.yaml", answer["content"]["application/json"]["schema"])
    for token, user, admin in (("tok-alice", "alice", False), ("tok-bob", "bob", False), ("tok-admin", "root", True)):
        status, view = broker.http("GET", "api/gpupool/pool", token=token)
        assert status == 200, view
        jsonschema.validate(view, schema)
        check_unpooled_view(view, user, admin, "openapi-broker.yaml")
