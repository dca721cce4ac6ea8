"""``python -m jupyter_gpupool.apps.simulate``: the same as ``jupyter gpupool simulate``."""

from jupyter_gpupool.apps.simulate.app import main

if __name__ == "__main__":
    main()
