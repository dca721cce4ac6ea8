# Installed by jupyter-gpupool into sys.prefix/etc/ipython. IPython kernels that no GPU pool
# provisioner started (jupyter nbconvert --execute, nbclient, papermill, nbgrader with the stock
# python3 kernelspec) lease their GPU slice from the pool as batch, or run CPU-only saying why.
# Off for a kernel: GPUPOOL_AUTOLEASE=off in its environment. If another package's
# ipython_kernel_config.py replaced this file, add these lines to that file.
try:
    from jupyter_gpupool.kernel.autolease import configure as _gpupool_configure
except ImportError:  # jupyter-gpupool was uninstalled: nothing to do
    pass
else:
    _gpupool_configure(get_config())  # noqa: F821 - IPython defines get_config() in its config files
