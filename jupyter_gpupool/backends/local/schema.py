"""The pool file's schema: the migrations that make and upgrade its tables, and what tells a pool
file from any other SQLite file."""

from __future__ import annotations

#: Each entry upgrades the schema from version ``i`` to ``i + 1``.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        owner TEXT NOT NULL,
        kernel_id TEXT,
        created_at REAL NOT NULL,
        data TEXT NOT NULL
    );
    CREATE INDEX leases_live ON leases(state) WHERE state != 'released';
    CREATE INDEX leases_kernel ON leases(kernel_id);
    CREATE TABLE ledger (
        lease_id TEXT NOT NULL,
        owner TEXT NOT NULL,
        groups TEXT NOT NULL,
        kernel_id TEXT,
        devices TEXT NOT NULL,
        memory INTEGER NOT NULL,
        start REAL NOT NULL,
        end REAL NOT NULL,
        active_seconds REAL NOT NULL
    );
    CREATE INDEX ledger_end ON ledger(end);
    CREATE TABLE usage (
        owner TEXT PRIMARY KEY,
        gib_hours REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        lease_id TEXT NOT NULL,
        kernel_id TEXT,
        owner TEXT NOT NULL,
        reason TEXT NOT NULL,
        deadline REAL
    );
    """,
    """
    CREATE TABLE reservations (
        name TEXT PRIMARY KEY,
        data TEXT NOT NULL
    );
    CREATE TABLE preferences (
        owner TEXT PRIMARY KEY,
        data TEXT NOT NULL
    );
    """,
    # Metering: what each GPU of a closed interval was (model, memory, MIG), for GPU-hours and
    # prices that stay right after the GPU leaves the inventory (NULL in older rows: see
    # Pool.report), and the memory held before each resize ([[when, bytes of all GPUs], ...]).
    """
    ALTER TABLE ledger ADD COLUMN device_info TEXT;
    ALTER TABLE ledger ADD COLUMN memory_history TEXT
    """,
    # Unpooled use: GPU memory NVML shows held by processes that belong to no granted lease, as
    # the watcher that owns the host's GPUs (a server's watchdog, the broker's) last saw it. Rows
    # expire, so a dead watcher's figures stop counting; every process deciding on the file plans
    # around the live ones. ``reporter`` is the watcher ("host:pid"), which replaces its rows whole.
    """
    CREATE TABLE unpooled_use (
        reporter TEXT NOT NULL,
        host TEXT NOT NULL,
        device TEXT NOT NULL,
        pid INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        user TEXT,
        command TEXT NOT NULL,
        lease_id TEXT,
        why TEXT NOT NULL,
        since REAL NOT NULL,
        expires_at REAL NOT NULL,
        stoppable INTEGER NOT NULL,
        PRIMARY KEY (reporter, host, device, pid)
    );
    CREATE INDEX unpooled_expiry ON unpooled_use(expires_at)
    """,
    # Elastic slices: what a closed interval was guaranteed (bytes, all GPUs), so the report bills
    # the burst held above it apart (NULL in older rows: everything held was guaranteed).
    """
    ALTER TABLE ledger ADD COLUMN guarantee INTEGER
    """,
    # What the file is a pool of, by name: ``simulated_inventory`` is the spec of the simulated
    # inventory it was opened with (e.g. ``2xA100-80GB``), so a command given only the file
    # (``--db``) opens the same simulated pool instead of looking for an NVIDIA driver.
    """
    CREATE TABLE pool_facts (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )
    """,
    # The limit a lease's user set (``limit_asked``): leases written before it existed keep the
    # limit they had (``burst_limit``; 0, a fixed slice, where they predate elastic slices), so a
    # later resize never changes a limit someone was given (None would recompute the pool's burst).
    """
    UPDATE leases SET data = json_set(data, '$.limit_asked', COALESCE(json_extract(data, '$.burst_limit'), 0))
    WHERE json_type(data, '$.limit_asked') IS NULL
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
#: The ``pool_facts`` name of a simulated pool's inventory spec.
SIMULATED_INVENTORY = "simulated_inventory"

#: ``PRAGMA application_id`` of a pool file ("JGPP"): what tells our file from another SQLite file.
APPLICATION_ID = 0x4A475050
#: The tables every pool file has (a file with none of them and no application id is not ours).
POOL_TABLES = frozenset({"leases", "ledger", "usage", "events"})
