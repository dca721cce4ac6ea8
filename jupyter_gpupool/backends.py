"""Which backend a pool runs on: this host's GPUs (the default), a broker (``GPUPOOL_URL``) or Slurm.

``c.GpuPool.backend = "slurm"`` (or ``GPUPOOL_BACKEND=slurm``) makes kernels run as Slurm jobs on
GPU shards; see docs/hpc.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from traitlets import Enum
from traitlets.config import Configurable

from .errors import InvalidInput

BACKENDS = ("local", "slurm")


class GpuPool(Configurable):
    """The backend every pool client in this process uses."""

    backend = Enum(
        ["", *BACKENDS],
        "",
        config=True,
        help="Where kernels get their GPU slices: 'local' (this host's GPUs, or the broker at $GPUPOOL_URL) or 'slurm' "
        "(each kernel a Slurm job with a GRES shard/gpu request; c.SlurmPool.*). Empty: $GPUPOOL_BACKEND, else 'local'.",
    )


def selected_backend(config: Any = None, environ: Mapping[str, str] | None = None) -> str:
    """``c.GpuPool.backend``, else ``$GPUPOOL_BACKEND``, else ``local``; a bad name is an InvalidInput."""
    env = os.environ if environ is None else environ
    name = ""
    if config is not None:
        try:
            name = str(GpuPool(config=config).backend or "")
        except Exception as err:  # noqa: BLE001 - traitlets' TraitError: say it in one line
            raise InvalidInput(f"c.GpuPool.backend: expected one of {', '.join(BACKENDS)} ({err})") from None
    name = name or (env.get("GPUPOOL_BACKEND") or "").strip().lower() or "local"
    if name not in BACKENDS:
        raise InvalidInput(f"GPUPOOL_BACKEND={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return name


def backend_provisioner(config: Any = None, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(entry point name, ``module:Class``) of the provisioner the selected backend's kernels use;
    the single-host one when the selection is invalid (the pool then reports why it is unavailable)."""
    try:
        slurm = selected_backend(config, environ) == "slurm"
    except InvalidInput:
        slurm = False
    if slurm:
        return "gpupool-slurm-provisioner", "jupyter_gpupool.slurm.provisioner:SlurmProvisioner"
    return "gpupool-provisioner", "jupyter_gpupool.provisioner:GpuPoolProvisioner"
