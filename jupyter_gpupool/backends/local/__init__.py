"""The single-host pool: decisions taken in every process that shares one SQLite pool file.

:mod:`.pool` (:class:`~jupyter_gpupool.backends.local.pool.Pool`: the engine over the file) and
:mod:`.store` (the file itself: schema, migrations, transactions, liveness).
"""
