"""A hostile local user's clients and a victim's, against a broker's Unix socket (or TCP port).

Run as a program (``python abuse_clients.py ATTACK --socket PATH ...``), usually as another Unix
user (``subprocess.Popen(..., user="nobody")``), by ``tests/test_broker_abuse.py`` and
``bench/broker_abuse.py``. Each attack holds what it took for ``--hold`` seconds, then prints one
JSON line: how many connections were answered with which status line, and how many are still open.
The victim makes requests one after another for ``--seconds`` (and at least ``--min-requests``) and
prints their latencies and statuses.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any


def connect(target: str) -> socket.socket:
    """A connected socket: ``unix:PATH`` or ``HOST:PORT``."""
    if target.startswith("unix:"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(target[5:])
    else:
        host, port = target.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    return sock


def status_line(sock: socket.socket, timeout: float) -> str:
    """The first line the broker sent within ``timeout`` seconds ("" if none; "closed" if it hung up)."""
    sock.settimeout(timeout)
    try:
        data = sock.recv(4096)
    except (TimeoutError, BlockingIOError):
        return ""
    except OSError:
        return "closed"
    if not data:
        return "closed"
    return data.split(b"\r\n", 1)[0].decode(errors="replace")


def request(target: str, method: str, path: str, body: Any = None, token: str | None = None, timeout: float = 30) -> tuple[int, Any]:
    """One HTTP request on a fresh connection; (status, JSON body or text). Status 0: no answer."""
    data = json.dumps(body).encode() if body is not None else b""
    head = f"{method} {path} HTTP/1.1\r\nHost: broker\r\nContent-Length: {len(data)}\r\nConnection: close\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    if token:
        head += f"Authorization: token {token}\r\n"
    try:
        sock = connect(target)
    except OSError:
        return 0, "connect failed"
    sock.settimeout(timeout)
    raw = b""
    try:
        try:
            sock.sendall(head.encode() + b"\r\n" + data)
        except OSError:
            pass  # refused before the body was read: the answer is there to read
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    except OSError as err:
        if not raw:
            return 0, str(err)
    finally:
        sock.close()
    head_text, _, payload = raw.partition(b"\r\n\r\n")
    try:
        status = int(head_text.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, raw[:200].decode(errors="replace")
    if b"chunked" in head_text.lower():
        payload = _unchunk(payload)
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload[:200].decode(errors="replace")


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_text, _, rest = data.partition(b"\r\n")
        size = int(size_text.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


def tally(lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in lines:
        counts[line] = counts.get(line, 0) + 1
    return counts


def attack_idle(target: str, count: int, hold: float) -> dict[str, Any]:
    """Open ``count`` connections and send nothing on them."""
    socks, failed = [], 0
    for _ in range(count):
        try:
            socks.append(connect(target))
        except OSError:
            failed += 1
    lines = [status_line(s, 0.5 if i == 0 else 0.01) for i, s in enumerate(socks)]
    time.sleep(max(0.0, hold - 0.5))
    lines = [line or status_line(s, 0.01) for line, s in zip(lines, socks)]
    still_open = sum(1 for line in lines if not line)
    for s in socks:
        s.close()
    return {"attack": "idle", "opened": len(socks), "connect_failed": failed, "answers": tally([l for l in lines if l]), "still_open": still_open}


def attack_bodies(target: str, count: int, size: int, hold: float, chunked: bool = False, repeat: bool = False) -> dict[str, Any]:
    """``count`` connections each POST a ``size``-byte body (declared, or chunked) and keep sending it;
    with ``repeat``, as each round is answered a new one starts, until ``hold`` seconds have passed."""
    deadline = time.monotonic() + hold
    lines: list[str] = []
    most_sent = rounds = 0
    while True:
        answered, sent = _bodies_round(target, count, size, deadline, chunked)
        lines += answered
        most_sent = max(most_sent, sent)
        rounds += 1
        if not repeat or time.monotonic() >= deadline:
            break
    return {"attack": "bodies", "connections": count, "rounds": rounds, "answers": tally(lines), "most_sent": most_sent}


def _bodies_round(target: str, count: int, size: int, deadline: float, chunked: bool) -> tuple[list[str], int]:
    socks = []
    piece = b"x" * 65536
    for _ in range(count):
        sock = connect(target)
        if chunked:
            head = "POST /api/gpupool/leases HTTP/1.1\r\nHost: broker\r\nTransfer-Encoding: chunked\r\n\r\n"
        else:
            head = f"POST /api/gpupool/leases HTTP/1.1\r\nHost: broker\r\nContent-Length: {size}\r\n\r\n"
        sock.sendall(head.encode())
        socks.append(sock)
    sent = [0] * count
    lines = [""] * count
    while time.monotonic() < deadline and any(not line for line in lines):
        for i, sock in enumerate(socks):
            if lines[i] or sent[i] >= size:
                continue
            try:
                sock.settimeout(0.05)
                data = (b"%x\r\n" % len(piece)) + piece + b"\r\n" if chunked else piece
                sock.sendall(data)
                sent[i] += len(piece)
            except (TimeoutError, BlockingIOError):
                pass
            except OSError:
                lines[i] = status_line(sock, 0.2) or "closed"
                continue
            lines[i] = status_line(sock, 0.001)
    lines = [line or status_line(s, 0.5) for line, s in zip(lines, socks)]
    for s in socks:
        s.close()
    return lines, max(sent)


def long_polls(target: str, count: int, hold: float) -> dict[str, Any]:
    """The load one user may legitimately put on the broker: ``count`` change polls held open
    (re-asked as each answers), as a server with many waiting kernels does."""
    _, first = request(target, "GET", "/api/gpupool/changes")
    version = first.get("version") if isinstance(first, dict) else 0
    line = f"GET /api/gpupool/changes?since={version}&timeout=30 HTTP/1.1\r\nHost: broker\r\n\r\n".encode()
    socks = []
    for _ in range(count):
        sock = connect(target)
        sock.sendall(line)
        socks.append(sock)
    time.sleep(hold)
    answered = sum(1 for s in socks if status_line(s, 0.001))
    for s in socks:
        s.close()
    return {"attack": "long polls", "held": count, "answered_early": answered}


def attack_reports(target: str, lease_id: str, count: int, seconds: float) -> dict[str, Any]:
    """Loop a forged "suspend done" report for one's own lease for ``seconds``; the statuses."""
    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    body = {"outcome": "done", "transition": "suspending", "parked_bytes": 0}
    while time.monotonic() < deadline:
        for _ in range(count):
            status, _ = request(target, "POST", f"/api/gpupool/leases/{lease_id}/transition", body, timeout=30)
            statuses.append(status)
    return {"attack": "reports", "answers": tally([str(s) for s in statuses])}


def victim(target: str, seconds: float, token: str | None = None, prefix: str = "", min_requests: int = 0) -> dict[str, Any]:
    """``whoami`` and a lease request (released at once) one after another for ``seconds``, and
    until ``min_requests`` were made (one slow answer on a loaded host then leaves a median to read)."""
    latencies: list[float] = []
    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline or len(latencies) < min_requests:
        n += 1
        start = time.monotonic()
        status, _ = request(target, "GET", f"{prefix}/api/gpupool/whoami", token=token, timeout=30)
        latencies.append(time.monotonic() - start)
        statuses.append(status)
        start = time.monotonic()
        status, lease = request(target, "POST", f"{prefix}/api/gpupool/leases", {"memory": "1GiB", "kernel_id": f"victim-{os.getpid()}-{n}", "duration": 60}, token=token, timeout=30)
        latencies.append(time.monotonic() - start)
        statuses.append(status)
        if isinstance(lease, dict) and lease.get("id"):
            request(target, "DELETE", f"{prefix}/api/gpupool/leases/{lease['id']}", token=token, timeout=30)
        time.sleep(0.02)
    ordered = sorted(latencies)
    return {
        "requests": len(latencies),
        "statuses": tally([str(s) for s in statuses]),
        "p50": ordered[len(ordered) // 2] if ordered else None,
        "p99": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else None,
        "max": ordered[-1] if ordered else None,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("what", choices=["idle", "bodies", "chunked", "reports", "longpolls", "victim", "lease", "suspend"])
    parser.add_argument("--target", required=True, help="unix:PATH or HOST:PORT")
    parser.add_argument("--count", type=int, default=1100)
    parser.add_argument("--size", type=int, default=99614720)
    parser.add_argument("--hold", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--min-requests", type=int, default=0, help="the victim goes on past --seconds until it made this many")
    parser.add_argument("--lease", default="")
    parser.add_argument("--token", default=None)
    parser.add_argument("--prefix", default="")
    parser.add_argument("--repeat", action="store_true", help="bodies, chunked: start a new round as each is answered, for --hold seconds")
    args = parser.parse_args(argv)
    if args.what == "idle":
        result = attack_idle(args.target, args.count, args.hold)
    elif args.what in ("bodies", "chunked"):
        result = attack_bodies(args.target, args.count, args.size, args.hold, chunked=args.what == "chunked", repeat=args.repeat)
    elif args.what == "longpolls":
        result = long_polls(args.target, args.count, args.hold)
    elif args.what == "reports":
        result = attack_reports(args.target, args.lease, args.count, args.seconds)
    elif args.what == "lease":
        status, body = request(args.target, "POST", "/api/gpupool/leases", {"memory": "2GiB", "suspendable": True, "duration": 600})
        result = {"status": status, "lease": body}
    elif args.what == "suspend":
        status, body = request(args.target, "POST", f"/api/gpupool/leases/{args.lease}/suspend", {"reason": "bench"})
        result = {"status": status, "lease": body}
    else:
        result = victim(args.target, args.seconds, args.token, args.prefix, args.min_requests)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
