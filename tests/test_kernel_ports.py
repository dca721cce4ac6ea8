"""A waiting kernel holds the ports of its connection file, and only those it can."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from jupyter_gpupool.kernel.ports import kernel_ports, ports_held


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def connection_file(tmp_path: Path, ports: list[int], **extra: object) -> str:
    names = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
    path = tmp_path / "kernel-1.json"
    path.write_text(json.dumps({"ip": "127.0.0.1", "transport": "tcp", **dict(zip(names, ports, strict=True)), **extra}))
    return str(path)


def bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_the_ports_are_taken_inside_the_block_and_free_after_it(tmp_path: Path):
    ports = free_ports(5)
    with ports_held(connection_file(tmp_path, ports)) as held:
        assert sorted(held) == sorted(ports)
        assert not any(bindable(port) for port in ports)
    assert all(bindable(port) for port in ports)


def test_a_port_someone_else_holds_is_left_to_them(tmp_path: Path):
    ports = free_ports(5)
    with socket.socket() as other:
        other.bind(("127.0.0.1", ports[2]))
        with ports_held(connection_file(tmp_path, ports)) as held:
            assert ports[2] not in held and len(held) == 4


def test_ipc_kernels_and_unreadable_files_hold_nothing(tmp_path: Path):
    assert kernel_ports(connection_file(tmp_path, free_ports(5), transport="ipc")) == ("", [])
    assert kernel_ports(str(tmp_path / "missing.json")) == ("", [])
    (tmp_path / "bad.json").write_text("{not json")
    with ports_held(str(tmp_path / "bad.json")) as held:
        assert held == []
