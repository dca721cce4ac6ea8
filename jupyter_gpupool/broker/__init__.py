"""The pool broker: one pool for every Jupyter server on a multi-user host.

``jupyter gpupool broker`` runs :class:`BrokerApp`; clients reach it through
:class:`jupyter_gpupool.backends.remote.RemotePool` when ``GPUPOOL_URL`` is set.
"""

from __future__ import annotations

from jupyter_gpupool.broker.app import Broker, BrokerApp, make_app
from jupyter_gpupool.broker.auth import ADMIN_SCOPE, HubIdentity, Identity, PeerCredIdentity

__all__ = ["ADMIN_SCOPE", "Broker", "BrokerApp", "HubIdentity", "Identity", "PeerCredIdentity", "make_app"]
