"""The ``gpupool`` Jupyter Server extension (auto-enabled by the wheel)."""

from jupyter_gpupool.serverextension.app import GpuPoolExtension

__all__ = ["GpuPoolExtension"]
