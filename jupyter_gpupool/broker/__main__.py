"""``python -m jupyter_gpupool.broker``: the same as ``jupyter gpupool broker`` (for service commands)."""

from jupyter_gpupool.broker.app import BrokerApp

if __name__ == "__main__":
    BrokerApp.launch_instance()
