"""An identity provider for real `jupyter server` processes in tests: the server's token
authenticates as one named user carrying JupyterHub-style scopes, as on a hub's single-user
server (``jupyterhub-singleuser`` puts the hub's user model, scopes included, on ``hub_user``)."""

from __future__ import annotations

from typing import Any

from jupyter_server.auth.identity import IdentityProvider, User
from traitlets import List, Unicode


class NamedUserIdentityProvider(IdentityProvider):  # type: ignore[misc]
    """The server's token is ``username``'s, with ``scopes`` as the hub would grant them."""

    username = Unicode("", config=True, help="The user the server's token authenticates as.")
    scopes = List(Unicode(), config=True, help="The hub scopes that user holds (e.g. custom:gpupool:admin).")

    async def get_user_token(self, handler: Any) -> User | None:  # type: ignore[override]
        if not self.token or self.get_token(handler) != self.token:
            return None
        handler._token_authenticated = True
        user = User(username=self.username, name=self.username, display_name=self.username)
        user.hub_user = {"name": self.username, "scopes": list(self.scopes)}  # type: ignore[attr-defined]
        return user
