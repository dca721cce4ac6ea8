"""The quiet channel: reach a kernel, or hear from it, without a cell and without it counting as activity.

jupyter_server moves a kernel's ``last_activity`` on almost every IOPub message and its
``execution_state`` on every shell request, comm messages included, and the pool reads its idle
clock from there. So anything the pool itself exchanges with a kernel (the ``PoolStatus``
widget's refreshes, and later freeing caches before a checkpoint or moving caps for a burst)
would keep that kernel "active" for ever and out of idle reclaim. Such traffic carries one
marker, :data:`QUIET_KEY`:

- **kernel → front end**: :func:`quiet_comm` / :func:`quiet_widget` make a comm (a widget and
  every widget it holds: children, layout, style) put ``{QUIET_KEY: true}`` in the metadata of
  each message it publishes;
- **server → kernel**: :func:`mark_quiet` puts ``QUIET_KEY`` in a request's header; the kernel
  copies that header into the ``parent_header`` of the busy/idle status and replies it causes.
  :func:`quiet_request` sends such a request on the kernel's *control* channel
  (:data:`QUIET_REQUEST`, answered by the handler :func:`install_quiet_requests` adds to the
  kernel): ipykernel serves control on a thread of its own, so the request is answered while a
  cell runs or waits (a cell sent while its kernel is being suspended waits for the resume, and a
  request queued behind it on the shell channel would never be answered), and the server waits
  for the answer a bounded time only. Freeing the frameworks' caches before a checkpoint uses it.

:class:`ActivityClocks` (server side) reads each kernel's IOPub as jupyter_server's
``start_watching_activity`` does, less the marked messages: the pool's idle clock. What a
person does (a cell, a click on a widget's button) is unmarked and counts as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import inspect
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

#: The marker, in a message's metadata (kernel → front end) or a request's header (server → kernel).
QUIET_KEY = "gpupool_quiet"

_QUIET_CLASSES: dict[type, type] = {}

#: IOPub messages that are plumbing, not activity: ipykernel greets each new subscriber (a browser
#: tab reconnecting, this module's own subscription).
PLUMBING = frozenset({"iopub_welcome"})


# --- kernel side ---------------------------------------------------------------------------------


def _quiet_class(base: type) -> type:
    """``base`` (a comm class) whose every published message carries the quiet marker."""
    known = _QUIET_CLASSES.get(base)
    if known is not None:
        return known

    class Quiet(base):  # type: ignore[valid-type,misc]
        def publish_msg(self, msg_type: str, data: Any = None, metadata: Any = None, buffers: Any = None, **keys: Any) -> Any:
            marked = {**(metadata or {}), QUIET_KEY: True}
            return super().publish_msg(msg_type, data=data, metadata=marked, buffers=buffers, **keys)

    Quiet.__name__ = Quiet.__qualname__ = f"Quiet{base.__name__}"
    _QUIET_CLASSES[base] = Quiet
    return Quiet


def quiet_comm(comm: Any) -> None:
    """Mark every message ``comm`` publishes from now on as quiet (idempotent; None is ignored)."""
    if comm is None or type(comm) in _QUIET_CLASSES.values():
        return
    comm.__class__ = _quiet_class(type(comm))


def _held_widgets(widget: Any) -> Iterable[Any]:
    """The widgets ``widget`` holds in its synced traits (children, layout, style, ...)."""
    from ipywidgets import Widget

    for name in getattr(widget, "keys", ()):
        value = getattr(widget, name, None)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, Widget):
                yield item


def quiet_widget(widget: Any) -> None:
    """Make ``widget`` and every widget it holds speak quietly: their state updates are no activity."""
    seen: set[int] = set()
    stack = [widget]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        quiet_comm(getattr(current, "comm", None))
        stack.extend(_held_widgets(current))


# --- both sides ----------------------------------------------------------------------------------


def mark_quiet(msg: dict[str, Any]) -> dict[str, Any]:
    """Mark a request built by ``Session.msg`` as quiet: what the kernel does for it is no activity."""
    msg["header"][QUIET_KEY] = True
    return msg


def is_quiet(msg: dict[str, Any]) -> bool:
    """A message of the quiet channel: marked itself, or caused by a marked request."""
    return bool((msg.get("metadata") or {}).get(QUIET_KEY) or (msg.get("parent_header") or {}).get(QUIET_KEY))


#: The message type of a request of the quiet channel on a kernel's control channel, and of its reply.
QUIET_REQUEST = "gpupool_quiet_request"
QUIET_REPLY = "gpupool_quiet_reply"

#: A quiet action: the request's content in, the reply's fields out (``status`` is added).
QuietAction = Callable[[dict[str, Any]], dict[str, Any]]


def install_quiet_requests(kernel: Any, actions: dict[str, QuietAction]) -> bool:
    """Answer :data:`QUIET_REQUEST` on ``kernel``'s control channel with ``actions[content["action"]]``
    (an ipykernel ``Kernel``); False where the kernel has no control handlers to add to."""
    handlers = getattr(kernel, "control_handlers", None)
    session = getattr(kernel, "session", None)
    if not isinstance(handlers, dict) or session is None:
        return False

    def handle(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        content = parent.get("content") or {}
        name = content.get("action") if isinstance(content, dict) else None
        action = actions.get(name) if isinstance(name, str) else None
        if action is None:
            reply: dict[str, Any] = {"status": "error", "message": f"unknown quiet action {name!r}; known: {', '.join(sorted(actions))}"}
        else:
            try:
                reply = {"status": "ok", **action(content)}
            except Exception as err:  # noqa: BLE001 -- one line back to the server, never a traceback in the kernel
                reply = {"status": "error", "message": f"{type(err).__name__}: {err}".splitlines()[0]}
        session.send(stream, QUIET_REPLY, reply, parent, ident)

    handlers[QUIET_REQUEST] = handle
    return True


# --- server side ---------------------------------------------------------------------------------


async def quiet_request(kernel: Any, action: str, timeout: float, **content: Any) -> dict[str, Any] | None:
    """Ask ``kernel`` (a server's kernel manager) for ``action`` on its control channel, marked quiet:
    no activity, answered even while a cell runs or waits. Its reply's content, or None when it did
    not answer within ``timeout`` seconds (a kernel without our extension never does)."""
    from jupyter_client.session import Session

    # A session of its own: the kernel's control socket routes replies by the session id, which
    # every client sharing the manager's session (the server's own channels, a test's) also uses.
    session = Session(config=kernel.session.config, key=kernel.session.key, signature_scheme=kernel.session.signature_scheme)
    client = kernel.client(session=session)
    started = client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    if inspect.isawaitable(started):  # a gateway's kernel client opens its websocket asynchronously
        await started
    try:
        msg = mark_quiet(client.session.msg(QUIET_REQUEST, {"action": action, **content}))
        client.control_channel.send(msg)
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                reply = await client.control_channel.get_msg(timeout=left)
            except (queue.Empty, asyncio.TimeoutError, TimeoutError):
                return None
            if (reply.get("parent_header") or {}).get("msg_id") == msg["header"]["msg_id"]:
                answer: dict[str, Any] = dict(reply.get("content") or {})
                return answer
    finally:
        with contextlib.suppress(Exception):
            client.stop_channels()




def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def recorded_activity(kernel: Any) -> datetime.datetime | None:
    """jupyter_server's ``last_activity`` of a kernel manager, or None before it recorded one: the
    server sets it once the kernel has started, and reading the trait before that raises TraitError."""
    from traitlets import TraitError

    try:
        value: datetime.datetime | None = getattr(kernel, "last_activity", None)
    except TraitError:
        return None
    return value


class ActivityClock:
    """One kernel's ``last_activity`` and ``execution_state`` as jupyter_server records them, less
    the quiet channel: its own IOPub subscription, read by jupyter_server's rules."""

    def __init__(self, kernel_manager: Any, kernel_id: str) -> None:
        from jupyter_client.session import Session

        kernel = kernel_manager.get_kernel(kernel_id)
        self._km = kernel_manager
        self.kernel_id = kernel_id
        #: jupyter_server's own subscription this clock follows (a restart replaces it, and so this clock).
        self.follows = getattr(kernel, "_activity_stream", None)
        self.last_activity: datetime.datetime = recorded_activity(kernel) or _utcnow()
        self.execution_state: str = getattr(kernel, "execution_state", None) or "starting"
        #: While busy: the type of the request it is busy with (``execute_request``, ``comm_msg``...), else "".
        self.busy_with = ""
        self.quiet_messages = 0
        self._session = Session(config=kernel.session.config, key=kernel.session.key)
        self._stream = kernel.connect_iopub()
        self._stream.on_recv(self._record)

    def _tracked(self, msg_type: str | None) -> bool:
        track = getattr(self._km, "track_message_type", None)
        return bool(track(msg_type)) if track is not None else msg_type is not None

    def _record(self, msg_list: list[bytes]) -> None:
        try:
            _idents, fed = self._session.feed_identities(msg_list)
            msg = self._session.deserialize(fed, content=False)
        except Exception:  # noqa: BLE001 -- a message we cannot read is no activity, and must not stop the stream
            return
        if is_quiet(msg):
            self.quiet_messages += 1
            return
        msg_type = msg["header"]["msg_type"]
        if msg_type in PLUMBING:
            return
        parent_type = (msg.get("parent_header") or {}).get("msg_type")
        if self._tracked(msg_type) or self._tracked(parent_type) or self.execution_state == "busy":
            self.last_activity = _utcnow()
        if msg_type == "status":
            with contextlib.suppress(Exception):
                state = self._session.unpack(msg["content"])["execution_state"]
                if self._tracked(parent_type):
                    self.execution_state = state
                    self.busy_with = str(parent_type) if state == "busy" else ""
                elif self.execution_state == "starting" and state != "starting":
                    self.execution_state = "idle"

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if not self._stream.closed():
                self._stream.close()


class ActivityClocks:
    """An :class:`ActivityClock` for each kernel a server runs, made when first asked for."""

    def __init__(self, kernel_manager: Any) -> None:
        self._km = kernel_manager
        self._clocks: dict[str, ActivityClock] = {}

    def clock(self, kernel_id: str) -> ActivityClock | None:
        """This kernel's clock (a new one after a restart), or None when it cannot be watched yet."""
        kernel = self._km.get_kernel(kernel_id)
        current = self._clocks.get(kernel_id)
        if current is not None and current.follows is getattr(kernel, "_activity_stream", None):
            return current
        if current is not None:
            current.close()
            del self._clocks[kernel_id]
        if getattr(kernel, "_activity_stream", None) is None:  # not started (pending), or being restarted
            return None
        try:
            self._clocks[kernel_id] = ActivityClock(self._km, kernel_id)
        except Exception:  # noqa: BLE001 -- no connection info yet: read jupyter_server's values this round
            return None
        return self._clocks[kernel_id]

    def forget_others(self, kernel_ids: Iterable[str]) -> None:
        """Close the clocks of kernels that are gone."""
        keep = set(kernel_ids)
        for kernel_id in [k for k in self._clocks if k not in keep]:
            self._clocks.pop(kernel_id).close()

    def close(self) -> None:
        self.forget_others(())
