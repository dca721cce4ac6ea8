"""The ``gpupool`` Jupyter Server extension (auto-enabled by the wheel)."""

from .app import GpuPoolExtension

__all__ = ["GpuPoolExtension"]
