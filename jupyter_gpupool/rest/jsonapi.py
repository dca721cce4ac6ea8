"""What both REST surfaces (the server extension and the broker) share: JSON in and out, and
bounded path arguments."""

from __future__ import annotations

import json
from typing import Any

from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.core.validate import MAX_ID, json_object
from jupyter_gpupool.errors import InvalidInput


def resize_on(pool: Any, lease: Lease, memory: int | str | None, seconds: float | None, limit: int | str | None) -> Lease:
    """Worker thread: a resize or reserve from a request body (see ``validate.resize_limit_body``),
    sizes read against the pool's GPUs (``limit``: how far the slice may grow, 0 for a fixed
    slice; None keeps the one it has)."""
    size = pool.parse_memory(memory) if memory is not None else None
    extra = {"limit": 0 if limit == 0 else pool.parse_memory(limit)} if limit is not None else {}
    updated: Lease = pool.resize(lease.id, memory=size, duration=seconds, **extra)
    return updated


class JsonHandlerMixin:
    """For tornado handlers: read a bounded JSON object body, write a JSON reply."""

    request: Any
    path_kwargs: dict[str, Any]

    def json_body(self) -> dict[str, Any]:
        """The request body as a dict (``{}`` when empty); a body that is not a JSON object, too large
        or nested too deep is a 400 (413) saying what to send (see :func:`~jupyter_gpupool.core.validate.json_object`)."""
        return json_object(self.request.body)

    def check_path_arguments(self) -> None:
        """A lease id, kernel id or name in the URL longer than any real one is a 400, not a lookup."""
        for name, value in (self.path_kwargs or {}).items():
            if isinstance(value, str) and len(value) > MAX_ID:
                raise InvalidInput(f"the {name} in the URL has {len(value)} characters; at most {MAX_ID} are accepted")

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)  # type: ignore[attr-defined]
        self.set_header("Content-Type", "application/json")  # type: ignore[attr-defined]
        self.finish(json.dumps(data, default=str))  # type: ignore[attr-defined]
