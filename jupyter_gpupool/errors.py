"""Domain errors. Adapters map them to exit codes (CLI) and HTTP statuses (REST)."""

from __future__ import annotations


class GpuPoolError(Exception):
    """Base class: the message is meant for the user, one line, saying what to do."""

    http_status = 500
    exit_code = 1


class InvalidInput(GpuPoolError, ValueError):
    """A size, duration or other value the user typed cannot be understood."""

    http_status = 400
    exit_code = 2


class RequestRefused(GpuPoolError):
    """A request that can never be granted (too big, over a hard quota, unknown GPU model)."""

    http_status = 409
    exit_code = 3


class SizeTooLarge(RequestRefused, InvalidInput):
    """A size beyond what any pool holds: refused as too large with exit code 3, like a request
    larger than this pool's GPUs, and still an :class:`InvalidInput` where a value is checked
    (over REST a 400, as every value outside the bounds the API accepts)."""

    http_status = 400


class LeaseNotFound(GpuPoolError, KeyError):
    """No lease (or kernel) with that id."""

    http_status = 404
    exit_code = 4

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "lease not found"


class NotAuthorized(GpuPoolError):
    """The caller may not see or act on that lease."""

    http_status = 403
    exit_code = 5


class PoolUnavailable(GpuPoolError):
    """The pool (store or broker) cannot be reached."""

    http_status = 503
    exit_code = 6


class TooManyWaits(PoolUnavailable):
    """A caller already holds as many open long polls (grant waits, change polls) as one user may;
    a client backs off and looks again, as over an outage."""

    http_status = 429


class NoGpuFound(PoolUnavailable):
    """No NVIDIA driver or GPU on this host and no simulated pool configured: kernels run CPU-only."""
