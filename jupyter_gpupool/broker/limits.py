"""What one caller may take of the broker before any work is done for them.

Every user's server and kernels reach the broker over the same socket (or, under JupyterHub, from
the same proxy address), so one local user with no rights at all could otherwise use up what all
of them share: descriptors (connections that never send a request), memory (request bodies read
whole before anyone is identified) and the broker's one worker thread. Here:

- :class:`ConnectionBook` counts open connections by who holds them: on the Unix socket by the
  peer's uid (``SO_PEERCRED``, known at accept), on TCP by address until a request on it is
  identified, then by user. Past a bound a new connection is answered at once with a
  ``429 Too Many Requests`` status line and closed; on TCP a full address budget first closes its
  oldest connection that has sent no request yet (every user's server may share that address).
- :class:`LimitedHTTPServer` applies it at accept, bounds headers and bodies and closes idle
  connections, and rides out running out of descriptors with one log line per interval instead
  of a traceback per accept.
- :class:`Throttle` bounds how often one caller may repeat something that was refused.
- :func:`raise_descriptor_limit` lifts the process's soft descriptor limit to its hard limit.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tornado import httpserver, iostream, netutil
from tornado.http1connection import HTTP1ServerConnection
from tornado.ioloop import IOLoop

from jupyter_gpupool.errors import TooManyWaits

#: accept() errors that mean "no descriptor or buffer left now", not a bug.
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class TooManyConnections(TooManyWaits):
    """A caller already holds as many connections to the broker as one user may (429); clients back off."""


class TooManyRefusals(TooManyWaits):
    """A caller's reports were refused too often lately; this one is not looked at (429, retry later)."""


class RateLimitedLog:
    """One log line per ``key`` per ``interval`` seconds; the lines left out are counted in the next one."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter[Any], interval: Callable[[], float]) -> None:
        self.log = log
        self._interval = interval
        self._last: dict[Any, tuple[float, int]] = {}

    def __call__(self, key: Any, level: int, message: str, *args: Any) -> None:
        now = time.monotonic()
        last, skipped = self._last.get(key, (float("-inf"), 0))
        if now - last < self._interval():
            self._last[key] = (last, skipped + 1)
            return
        if len(self._last) > 10_000:  # many callers over a long life: forget the quiet ones
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self._interval()}
        self._last[key] = (now, 0)
        suffix = f" (and {skipped} more like it since the last such line)" if skipped else ""
        self.log.log(level, message + suffix, *args)


@dataclass
class _Connection:
    key: tuple[str, str]
    stream: iostream.IOStream
    busy: bool = False


@dataclass
class ConnectionBook:
    """Open connections by holder; the bounds are read at each use (0: no bound)."""

    per_user: Callable[[], int]
    per_address: Callable[[], int]
    _open: dict[int, _Connection] = field(default_factory=dict)
    _count: dict[tuple[str, str], int] = field(default_factory=dict)
    #: per TCP address, its connections that sent no request yet, oldest first
    _unidentified: dict[str, deque[int]] = field(default_factory=dict)

    def count(self, key: tuple[str, str]) -> int:
        """Connections ``key`` (``("uid", "1000")``, ``("address", ip)``, ``("user", name)``) holds now."""
        return self._count.get(key, 0)

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, stream: iostream.IOStream, key: tuple[str, str]) -> str | None:
        """Count a new connection; the reason it is refused, or None."""
        if key[0] == "address":
            bound = self.per_address()
            queue = self._unidentified.setdefault(key[1], deque())
            while bound > 0 and self.count(key) >= bound and queue:
                oldest = self._open.get(queue.popleft())
                if oldest is not None and not oldest.busy:  # it sent nothing yet: the newcomer may be a real request
                    self.closed(oldest.stream)
                    LimitedHTTPServer.refuse(
                        oldest.stream,
                        f"closed to make room: {key[1]} holds {bound} connections with no request answered yet "
                        f"(c.Broker.max_unidentified_per_address), and this one had sent none",
                    )
            if bound > 0 and self.count(key) >= bound:
                return (
                    f"{key[1]} holds {self.count(key)} connections to the GPU pool broker with no request "
                    f"answered yet, the most one address may (c.Broker.max_unidentified_per_address = {bound})"
                )
            queue.append(id(stream))
        else:
            bound = self.per_user()
            if bound > 0 and self.count(key) >= bound:
                return self._over(key, bound)
        self._open[id(stream)] = _Connection(key, stream)
        self._count[key] = self.count(key) + 1
        return None

    def _over(self, key: tuple[str, str], bound: int) -> str:
        who = f"uid {key[1]}" if key[0] == "uid" else f"user {key[1]}"
        return (
            f"{who} already holds {self.count(key)} connections to the GPU pool broker, the most one user may "
            f"(c.Broker.max_connections_per_user = {bound}); close some (or wait for idle ones to time out)"
        )

    def make_room(self) -> bool:
        """Close the oldest connection that is not serving a request of the holder with the most
        connections (a ``429`` saying why): the process is out of room for connections, and one
        user's idle ones must not keep everyone else's in the backlog. False if none could be."""
        if not self._count:
            return False
        heaviest = max(self._count, key=lambda key: self._count[key])
        for conn in self._open.values():
            if conn.key == heaviest and not conn.busy:
                self.closed(conn.stream)
                LimitedHTTPServer.refuse(
                    conn.stream,
                    "closed to make room: the GPU pool broker holds as many connections as its open-file limit "
                    "allows, the most of them this caller's, and this one was serving no request",
                )
                return True
        return False

    def holder(self, stream: Any) -> tuple[str, str] | None:
        """Whom this connection counts for now (see :meth:`count`), or None if it is not counted."""
        conn = self._open.get(id(stream))
        return conn.key if conn is not None else None

    def started(self, stream: Any) -> None:
        """A request arrived on this connection: never closed to make room while it is served."""
        conn = self._open.get(id(stream))
        if conn is not None:
            conn.busy = True

    def finished(self, stream: Any) -> None:
        conn = self._open.get(id(stream))
        if conn is not None:
            conn.busy = False

    def identified(self, stream: Any, name: str) -> str | None:
        """A request on a TCP connection was identified as ``name``: the connection counts as that
        user's from now on. The reason it is refused (that user holds as many as one may), or None."""
        conn = self._open.get(id(stream))
        if conn is None or conn.key[0] != "address":
            return None
        user = ("user", name)
        bound = self.per_user()
        if bound > 0 and self.count(user) >= bound:
            return self._over(user, bound)
        self._drop(conn)
        queue = self._unidentified.get(conn.key[1])
        if queue is not None:
            try:
                queue.remove(id(stream))
            except ValueError:
                pass
            if not queue:
                del self._unidentified[conn.key[1]]
        conn.key = user
        self._open[id(stream)] = conn
        self._count[user] = self.count(user) + 1
        return None

    def closed(self, stream: Any) -> None:
        conn = self._open.pop(id(stream), None)
        if conn is None:
            return
        self._drop(conn)
        if conn.key[0] == "address":
            queue = self._unidentified.get(conn.key[1])
            if queue is not None and not self.count(conn.key):
                del self._unidentified[conn.key[1]]

    def _drop(self, conn: _Connection) -> None:
        left = self.count(conn.key) - 1
        if left > 0:
            self._count[conn.key] = left
        else:
            self._count.pop(conn.key, None)


def peer_key(sock: socket.socket | None, address: Any) -> tuple[str, str]:
    """Who holds a new connection: the peer's uid on a Unix socket, else its address."""
    if sock is not None and sock.family == socket.AF_UNIX:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return "uid", str(struct.unpack("3i", raw)[1])
    host = address[0] if isinstance(address, tuple) and address else str(address)
    return "address", str(host)


def refusal_response(status: int, reason: str, error: str, message: str) -> bytes:
    """A whole HTTP answer (status line, JSON body) to write on a connection before closing it."""
    body = json.dumps({"error": error, "message": message}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class LimitedHTTPServer(httpserver.HTTPServer):
    """The broker's HTTP server: :class:`ConnectionBook` at accept, and accept errors ridden out.

    Construct with ``LimitedHTTPServer(app, book=..., log=..., **HTTPServer options)``.
    """

    book: ConnectionBook
    note: RateLimitedLog
    #: Seconds accepting pauses after running out of descriptors.
    accept_pause = 0.1
    #: Descriptors kept free for the work of the connections already open (the pool file, the
    #: user and group databases a request's identity is read from, the driver): accepting pauses
    #: when only these are left, so no request fails for want of one.
    descriptor_reserve = 32

    def initialize(self, *args: Any, book: ConnectionBook, note: RateLimitedLog, **kwargs: Any) -> None:  # type: ignore[override]
        super().initialize(*args, **kwargs)
        self.book = book
        self.note = note
        self._streams: dict[int, iostream.IOStream] = {}
        self._most_connections: int | None = None

    def most_connections(self) -> int:
        """Connections this process may hold open: its soft descriptor limit less the descriptors it
        held before its first connection and :attr:`descriptor_reserve` (at least 1)."""
        if self._most_connections is None:
            try:
                held = len(os.listdir("/proc/self/fd"))
            except OSError:
                held = 64
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            room = soft - held - self.descriptor_reserve if soft != resource.RLIM_INFINITY else 1 << 30
            self._most_connections = max(1, room)
        return self._most_connections

    def add_sockets(self, sockets: Any) -> None:
        for sock in sockets:
            self._sockets[sock.fileno()] = sock
            self._handlers[sock.fileno()] = self._accepting(sock)

    def _accepting(self, sock: socket.socket) -> Callable[[], None]:
        """Like :func:`tornado.netutil.add_accept_handler`, but out of descriptors it logs one line
        per interval and pauses accepting a moment (the pending connections wait in the backlog)."""
        loop = IOLoop.current()
        state = {"removed": False, "paused": False}

        def resume() -> None:
            if not state["removed"] and state["paused"]:
                state["paused"] = False
                loop.add_handler(sock, accept, IOLoop.READ)

        def pause(why: str) -> None:
            self.note(
                "descriptors", logging.ERROR,
                "gpupool broker: not accepting connections for now: %s (%d open); new ones wait in the "
                "backlog; raise LimitNOFILE or lower c.Broker.max_connections_per_user",
                why, len(self.book),
            )  # fmt: skip
            loop.remove_handler(sock)
            state["paused"] = True
            loop.call_later(self.accept_pause, resume)

        def accept(fd: Any, events: int) -> None:
            for _ in range(netutil._DEFAULT_BACKLOG):
                if state["removed"]:
                    return
                if len(self.book) >= self.most_connections():
                    if not self.book.make_room():
                        pause(f"the open-file limit leaves room for {self.most_connections()} connections, all serving requests")
                        return
                    self.note(
                        "room", logging.WARNING,
                        "gpupool broker: the open-file limit leaves room for %d connections; closed the oldest idle "
                        "one of the caller holding the most to accept another; raise LimitNOFILE or lower "
                        "c.Broker.max_connections_per_user",
                        self.most_connections(),
                    )  # fmt: skip
                try:
                    connection, address = sock.accept()
                except BlockingIOError:
                    return
                except ConnectionAbortedError:
                    continue
                except OSError as err:
                    if err.errno not in _OUT_OF_DESCRIPTORS:
                        raise
                    pause(f"cannot accept: {err.strerror or err}")
                    return
                self._handle_connection(connection, address)

        def remove() -> None:
            if not state["paused"]:
                loop.remove_handler(sock)
            state["removed"] = True

        loop.add_handler(sock, accept, IOLoop.READ)
        return remove

    def handle_stream(self, stream: iostream.IOStream, address: Any) -> None:
        key = peer_key(stream.socket if isinstance(stream.socket, socket.socket) else None, address)
        refusal = self.book.admit(stream, key)
        if refusal is not None:
            self.note(("refused", key), logging.WARNING, "gpupool broker: refused a connection: %s", refusal)
            self.refuse(stream, refusal)
            return
        context = httpserver._HTTPRequestContext(stream, address, self.protocol, self.trusted_downstream)
        conn = HTTP1ServerConnection(stream, self.conn_params, context)
        self._connections.add(conn)
        self._streams[id(conn)] = stream
        conn.start_serving(self)

    def on_close(self, server_conn: object) -> None:
        super().on_close(server_conn)
        stream = self._streams.pop(id(server_conn), None)
        if stream is not None:
            self.book.closed(stream)

    @staticmethod
    def refuse(stream: iostream.IOStream, message: str) -> None:
        """Answer ``429`` with ``message`` and close at once: a refused connection must not hold a
        descriptor. What the client sent already is read first, so that closing does not reset the
        connection (on TCP a reset can drop the answer before the client reads it)."""
        answer = refusal_response(429, "Too Many Requests", "TooManyConnections", message)
        sock = stream.socket
        try:
            sock.setblocking(False)
            try:
                sock.recv(65536)
            except OSError:
                pass
            sock.send(answer)  # a fresh socket's send buffer takes a few hundred bytes at once
        except OSError:
            pass
        stream.close()


class Throttle:
    """Each caller's refused tries over the last ``window()`` seconds: at most ``allowed()`` of them,
    taking at most ``budget()`` seconds of the shared worker together; past either, the caller waits
    until the oldest leaves the window (0 for either bound: none)."""

    def __init__(self, allowed: Callable[[], int], window: Callable[[], float], budget: Callable[[], float] = lambda: 0.0) -> None:
        self._allowed = allowed
        self._window = window
        self._budget = budget
        self._refused: dict[str, deque[tuple[float, float]]] = {}

    def wait_left(self, caller: str, now: float | None = None) -> float:
        """Seconds before ``caller`` may try again (0: now)."""
        allowed, window, budget = self._allowed(), self._window(), self._budget()
        tries = self._refused.get(caller)
        if not tries:
            return 0.0
        now = time.monotonic() if now is None else now
        while tries and now - tries[0][0] >= window:
            tries.popleft()
        if not tries:
            del self._refused[caller]
            return 0.0
        over = (allowed > 0 and len(tries) >= allowed) or (budget > 0 and sum(cost for _, cost in tries) >= budget)
        return window - (now - tries[0][0]) if over else 0.0

    def refused(self, caller: str, cost: float = 0.0, now: float | None = None) -> None:
        """One more of ``caller``'s tries was refused, after ``cost`` seconds of work."""
        self._refused.setdefault(caller, deque()).append((time.monotonic() if now is None else now, cost))


def raise_descriptor_limit(log: logging.Logger | logging.LoggerAdapter[Any] | None = None) -> tuple[int, int]:
    """Lift this process's soft limit on open descriptors to its hard limit; returns (soft, hard) now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:
            if log is not None:
                log.warning("gpupool broker: could not raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft, hard


__all__ = [
    "ConnectionBook",
    "LimitedHTTPServer",
    "RateLimitedLog",
    "Throttle",
    "TooManyConnections",
    "TooManyRefusals",
    "peer_key",
    "raise_descriptor_limit",
    "refusal_response",
]
