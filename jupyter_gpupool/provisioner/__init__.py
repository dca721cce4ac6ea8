"""Kernel provisioners: every kernel start asks the pool for a slice.

``gpupool-provisioner`` (:class:`GpuPoolProvisioner`, :mod:`.kernel_provisioner`) for the
single-host pool and the broker, ``gpupool-slurm-provisioner`` (:class:`SlurmProvisioner`,
:mod:`.slurm`) for kernels run as Slurm jobs.
"""

from __future__ import annotations

from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner
from jupyter_gpupool.provisioner.slurm import SlurmProvisioner

__all__ = ["GpuPoolProvisioner", "SlurmProvisioner"]
