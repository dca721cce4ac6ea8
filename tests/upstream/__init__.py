"""Upstream test suites (jupyter_server, nbclient, papermill, jupyter_client) run bare and with
the project active; ``python -m tests.upstream --help``."""
