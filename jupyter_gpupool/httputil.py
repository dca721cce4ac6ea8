"""What both REST surfaces (the server extension and the broker) share: JSON in and out."""

from __future__ import annotations

import json
from typing import Any

from .errors import InvalidInput


class JsonHandlerMixin:
    """For tornado handlers: read a JSON object body, write a JSON reply."""

    request: Any

    def json_body(self) -> dict[str, Any]:
        """The request body as a dict (``{}`` when empty); bad JSON is a 400 saying what to send."""
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError:
            raise InvalidInput('the request body is not JSON; send an object such as {"memory": "12GiB"}') from None
        if not isinstance(data, dict):
            raise InvalidInput('the request body must be a JSON object such as {"memory": "12GiB"}')
        return data

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)  # type: ignore[attr-defined]
        self.set_header("Content-Type", "application/json")  # type: ignore[attr-defined]
        self.finish(json.dumps(data, default=str))  # type: ignore[attr-defined]
