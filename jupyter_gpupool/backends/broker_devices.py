"""The broker's GPUs as its clients see them: :class:`RemoteBackend`, the device backend of a
:class:`~jupyter_gpupool.backends.remote.RemotePool`, and :class:`BrokerGpus`, what a pooled
user's own process (its Jupyter server) reads of this host's GPUs for checkpoints, where device
control denies it every GPU node."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.errors import GpuPoolError

if TYPE_CHECKING:
    from jupyter_gpupool.backends.remote import RemotePool

log = logging.getLogger(__name__)


class RemoteBackend:
    """The device backend as a :class:`RemotePool` client sees it: the broker's devices."""

    name = "remote"

    def __init__(self, pool: RemotePool) -> None:
        self._pool = pool

    @property
    def spec(self) -> str:
        return str(self._pool.info().get("backend", {}).get("spec", ""))

    def devices(self) -> list[Device]:
        return self._pool.devices()

    def process_usage(self) -> list[Any]:
        return []  # the broker's watchdog measures; clients never do

    def describe(self) -> str:
        remote = self._pool.info().get("backend", {}).get("describe", "")
        return f"broker {self._pool.url}" + (f" ({remote})" if remote else "")

    def close(self) -> None:
        """Nothing to release: connections are per request."""


class BrokerGpus:
    """This host's GPUs as a pooled user's process under a broker reads them, for checkpoints.

    Device control denies that process every GPU node, so NVML there cannot read them: the list
    (every GPU, its memory and health) and the driver's versions come from the broker. Only the GPU
    memory of processes is read here, from NVML, of the GPUs this process may open (none under
    device control: the count is then unknown, which a checkpoint's driver call does not need)."""

    name = "nvml"  # what the broker's GPUs are: a CUDA checkpoint parks its kernels

    def __init__(self, pool: RemotePool) -> None:
        self._pool = pool
        self._local: Any = None

    def _backend_info(self) -> dict[str, Any]:
        return dict(self._pool.info().get("backend") or {})

    def driver_versions(self) -> tuple[str | None, int | None]:
        """The broker's NVIDIA driver version and the CUDA API it offers (None: the broker does not say)."""
        about = self._backend_info()
        cuda = about.get("cuda_driver_version")
        return (str(about.get("driver_version") or "") or None, int(cuda) if isinstance(cuda, int) else None)

    def devices(self) -> list[Device]:
        return self._pool.devices()

    def process_usage(self) -> list[Any]:
        """GPU memory per process on the GPUs this process may open; [] when NVML cannot be read here."""
        if self._local is None:
            from jupyter_gpupool.devices.nvml import NvmlBackend  # only a suspend gets here

            try:
                self._local = NvmlBackend()
            except GpuPoolError as err:
                log.debug("no NVML in this process: %s", err)
                return []
        try:
            return list(self._local.process_usage())
        except GpuPoolError as err:
            log.debug("NVML could not list GPU processes here: %s", err)
            return []

    def describe(self) -> str:
        return f"the GPUs of the broker at {self._pool.url}"

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
            self._local = None


__all__ = ["BrokerGpus", "RemoteBackend"]
