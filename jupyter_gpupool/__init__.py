"""jupyter-gpupool: pool the GPU memory of a host across Jupyter kernels."""

from __future__ import annotations

from typing import Any

from jupyter_gpupool._version import __version__


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """The ``gpupool`` server extension (imported only when the server loads it)."""
    # only when a server loads the extension: importing the package stays light
    from jupyter_gpupool.serverextension import GpuPoolExtension

    return [{"module": "jupyter_gpupool.serverextension", "app": GpuPoolExtension}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt JupyterLab extension shipped in the wheel."""
    return [{"src": "labextension", "dest": "jupyter-gpupool"}]


__all__ = ["__version__"]
