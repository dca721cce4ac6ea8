"""jupyter-gpupool: pool the GPU memory of a host across Jupyter kernels."""

from ._version import __version__

__all__ = ["__version__"]
