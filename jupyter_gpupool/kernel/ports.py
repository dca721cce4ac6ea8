"""Keep a waiting kernel's TCP ports its own until it binds them.

A client picks a kernel's ports (free at that moment), writes them to the connection file and
starts the kernel. A kernel that waits for its GPU before binding them leaves them free for as
long as it waits: another process may take one, and so may its own client, whose sockets keep
reconnecting to them (a local TCP connect from an ephemeral port equal to the port it dials
connects to itself). The kernel would then fail to start with "Address already in use".
Holding each port bound (not listening: a connect is still refused) while the kernel waits
keeps every such taker away; it is let go just before the kernel binds it.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path

#: The connection file's port fields (jupyter_client's ``port_names``).
PORT_FIELDS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def kernel_ports(connection_file: str) -> tuple[str, list[int]]:
    """The address and TCP ports a kernel binds, from its connection file ("" and none for IPC,
    a missing or unreadable file, or ports the kernel picks itself)."""
    try:
        info = json.loads(Path(connection_file).read_text())
    except (OSError, ValueError):
        return "", []
    if not isinstance(info, dict) or info.get("transport", "tcp") != "tcp":
        return "", []
    ports = [port for port in (info.get(name) for name in PORT_FIELDS) if isinstance(port, int) and 0 < port < 65536]
    return str(info.get("ip") or "127.0.0.1"), ports


@contextlib.contextmanager
def ports_held(connection_file: str) -> Iterator[list[int]]:
    """Bind the kernel's ports for the duration of the block; yields those it could bind (one
    taken already is left alone: the kernel will say so when it binds it)."""
    ip, ports = kernel_ports(connection_file)
    address = "0.0.0.0" if ip in ("*", "") else ip  # the address the kernel itself binds
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    held: list[socket.socket] = []
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
        except OSError:
            sock.close()
            continue
        held.append(sock)
    try:
        yield [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


__all__ = ["PORT_FIELDS", "kernel_ports", "ports_held"]
