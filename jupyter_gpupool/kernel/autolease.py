"""Kernels that no provisioner of the pool started ask for their own lease, as ``batch``.

``jupyter nbconvert --execute``, nbclient, papermill and nbgrader's autograder start the stock
``python3`` kernelspec through jupyter_client's local provisioner, and pass no configuration that
could name ours. Such a kernel still reads IPython's kernel config from ``sys.prefix/etc/ipython``
(where the wheel installs ``ipython_kernel_config.py``), and it reads it before it binds its
sockets, long before a cell can initialise CUDA (which reads ``CUDA_VISIBLE_DEVICES`` once, at its
first call). From there :func:`configure`

1. stands aside when the kernel already has the pool's word (``GPUPOOL_LEASE_ID``,
   ``GPUPOOL_UNAVAILABLE`` or ``GPUPOOL_KERNEL_ID`` in its environment: the provisioner started it),
   when an admin opted it out (``GPUPOOL_AUTOLEASE=off``, which a server with
   ``make_default_provisioner = False`` puts in its kernels' environment, or a kernelspec that names
   ``local-provisioner``), inside a Slurm job (Slurm allocated its GPUs), and, without looking
   further, when this host has no NVIDIA driver and no simulated pool;
2. otherwise hides every GPU at once, asks the pool for a ``batch`` lease held by this kernel's
   process, and on a grant sets ``CUDA_VISIBLE_DEVICES`` to its GPUs with the framework caps of
   :mod:`jupyter_gpupool.enforcement.plan`; a request that must queue leaves the GPUs hidden and the
   kernel waits for the grant *before it answers* ``kernel_info`` (its client's start, which every
   client bounds by a start timeout, 60 s by default, and never by a per-cell or per-run deadline),
   up to :data:`START_WAIT_ENV` seconds after it started (45 by default, below those 60 s); a longer
   wait goes on in the first cell (one line on the terminal, a progress line in the cell that is
   cleared once it is granted). A first cell whose wait is stopped (a per-cell timeout's interrupt)
   ends a ``batch`` kernel, so that no later cell runs as if it had run;
3. loads the kernel extension (``%gpupool``, caps, activity heartbeats) once the shell exists;
4. re-executes the kernel (same pid, before it binds a socket) so that the environment it starts
   with, the one the pool's watcher reads in ``/proc``, names its lease;
5. gives the lease back when the kernel is asked to shut down (before it replies, so a kernel its
   manager must terminate for being slow to exit gives it back too), or else when it exits. A killed kernel's lease goes back through the
   pool's holder check: its ``holder_pid`` is this process, so the next scheduling round of any
   process on this host releases it.

Any failure leaves the kernel CPU-only (``CUDA_VISIBLE_DEVICES=""``) with one line saying why;
nothing here may stop a kernel from starting. Only IPython kernels read this config: an R or
Julia kernel started without the provisioner is not reached.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# In-function imports: every kernel of this environment reads this module at start, and most stand
# aside; the pool's modules are imported only by one that leases.

#: Set to ``off`` (also ``0``, ``false``, ``no``) in a kernel's environment: this module stands aside.
AUTOLEASE_ENV = "GPUPOOL_AUTOLEASE"
OFF_VALUES = ("off", "0", "false", "no")
#: Variables the provisioner puts in the environment of every kernel it starts.
PROVISIONED_ENV = ("GPUPOOL_LEASE_ID", "GPUPOOL_UNAVAILABLE", "GPUPOOL_KERNEL_ID")
#: Provisioners of ours: a kernelspec naming one of them is pooled by its provisioner.
OUR_PROVISIONERS = ("gpupool-provisioner", "gpupool-slurm-provisioner")
#: Where an NVIDIA driver shows itself; neither present and no simulated pool: no GPU to pool.
NVIDIA_MARKERS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")  # as devices.base.NVIDIA_MARKERS
KERNEL_EXTENSION = "jupyter_gpupool.kernel"
#: A hint a Jupyter server with the pool's extension sends with the kernels it asks a kernel gateway
#: for (a ``KERNEL_`` variable: every gateway passes those on): a person started this kernel, so a
#: gateway kernel leases as ``normal``, not ``batch``. A hint only: it never chooses a pool or whether to pool.
INTERACTIVE_HINT_ENV = "KERNEL_GPUPOOL_INTERACTIVE"
#: Set on a gateway's own side (its environment or the kernelspec) to ``1``: charge a gateway kernel's
#: lease to the ``KERNEL_USERNAME`` its client asserts, not to the gateway's Unix user.
TRUST_USERNAME_ENV = "GPUPOOL_GATEWAY_TRUST_KERNEL_USERNAME"
#: Settings that choose the pool or whether to pool: in a gateway kernel, only the gateway's side may set them.
POOL_CHOICE_ENV = ("GPUPOOL_DB", "GPUPOOL_URL", "GPUPOOL_SIMULATE", "GPUPOOL_TOKEN", "GPUPOOL_BACKEND",
                   "GPUPOOL_BROKER_FILE", "GPUPOOL_BROKER_USER", "GPUPOOL_AUTOLEASE", "GPUPOOL_SLURM_STATE")
#: Names other than ``GPUPOOL_*`` that a gateway kernel takes from the gateway's side only.
GATEWAY_GUARDED_ENV = ("JUPYTERHUB_USER", "NVIDIA_VISIBLE_DEVICES")
#: Programs in a parent process's command line that name a kernel gateway (a word's last path part,
#: bare or as ``jupyter-WORD``: ``jupyter-enterprisegateway``, ``python -m enterprise_gateway``).
GATEWAY_PROGRAMS = {"kernelgateway": "Jupyter Kernel Gateway", "kernel_gateway": "Jupyter Kernel Gateway",
                    "enterprisegateway": "Jupyter Enterprise Gateway", "enterprise_gateway": "Jupyter Enterprise Gateway"}
#: What a lease taken here is released with when the kernel exits.
EXIT_REASON = "kernel shut down"
#: ``<pid>:<lease id>:<queued|granted>[:<parent pid>]``: set when the kernel re-executes itself with its lease
#: in its environment (the parent: the client that started it, which may exit before the new image runs).
REEXEC_ENV = "GPUPOOL_AUTOLEASE_HELD"
#: Seconds from the kernel process's start within which a queued kernel waits for its grant before
#: it answers ``kernel_info`` (its client's start). Below nbclient's, nbconvert's, papermill's,
#: nbgrader's and ``jupyter run``'s 60 s start timeout, with room to start once the wait ends;
#: ``0``: answer at once and wait in the first cell.
START_WAIT_ENV = "GPUPOOL_START_WAIT"
DEFAULT_START_WAIT = 45.0
#: What a lease is released with when the client that started its kernel is gone while it waits.
CLIENT_LEFT_REASON = "the kernel's client left while it waited for a GPU"


def start_wait(environ: Mapping[str, str], quiet: bool = False) -> float:
    """``GPUPOOL_START_WAIT`` in seconds (the default where unset; a bad value says so, unless
    ``quiet``, and uses the default)."""
    raw = environ.get(START_WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_START_WAIT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < 3600:
        if not quiet:
            say(f"ignored {START_WAIT_ENV}={raw!r}: give seconds from 0 to 3599 (e.g. {START_WAIT_ENV}=50); using {DEFAULT_START_WAIT:.0f}")
        return DEFAULT_START_WAIT
    return value


#: The terminal of the program that started the kernel, kept before ipykernel takes its stderr.
_terminal: list[Any] = []


def keep_terminal() -> None:
    """Keep this process's stderr as it is now, at kernel start: ipykernel later sends file
    descriptor 2 into the running cell (it forwards extension libraries' output), and a line for
    the terminal must never end up in a cell's saved output."""
    if _terminal:
        return
    try:
        _terminal.append(os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace"))
    except OSError:  # no stderr: say() falls back to sys.__stderr__
        pass


def say(text: str, stream: Any = None) -> None:
    """One line on the terminal of the program that started the kernel, never in a cell (never raises)."""
    try:
        target = stream or (_terminal[0] if _terminal else None) or sys.__stderr__ or sys.stderr
        target.write(f"gpupool: {text}\n")
        target.flush()
    except Exception:  # noqa: BLE001, S110 - a closed stderr must not stop the kernel
        pass


def opted_out(environ: Mapping[str, str]) -> bool:
    """Whether ``GPUPOOL_AUTOLEASE`` says ``off``."""
    return environ.get(AUTOLEASE_ENV, "").strip().lower() in OFF_VALUES


def has_gpu_to_pool(environ: Mapping[str, str], markers: tuple[str, ...] = NVIDIA_MARKERS) -> bool:
    """A simulated pool is configured, or this host shows an NVIDIA driver (two ``stat`` calls)."""
    if environ.get("GPUPOOL_SIMULATE", "").strip():
        return True
    return any(os.path.exists(path) for path in markers)


def kernel_name_of(connection_file: str) -> str:
    """The kernelspec name jupyter_client wrote into the connection file ('' when it cannot tell)."""
    if not connection_file:
        return ""
    path = Path(connection_file)
    if not path.is_absolute():
        from jupyter_core.paths import jupyter_runtime_dir

        path = Path(jupyter_runtime_dir()) / path
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    name = info.get("kernel_name") if isinstance(info, dict) else None
    return name if isinstance(name, str) else ""


def named_provisioner(kernel_name: str) -> str | None:
    """The provisioner the kernelspec ``kernel_name`` names, or None when it names none (or is not found)."""
    if not kernel_name:
        return None
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(kernel_name)
    except (NoSuchKernel, OSError, ValueError):
        return None
    metadata = spec.metadata if isinstance(spec.metadata, dict) else {}
    section = metadata.get("kernel_provisioner")
    name = section.get("provisioner_name") if isinstance(section, dict) else None
    return name if isinstance(name, str) and name else None


def gateway_of(environ: Mapping[str, str], parent_cmdline: Callable[[], str] | None = None) -> str | None:
    """The kernel gateway that started this kernel (``Jupyter Kernel Gateway``...), or None.

    A gateway is known by its program in the parent process's command line; Kernel Gateway (and
    Enterprise Gateway 3, which is told apart by its program) also marks its kernels
    ``KERNEL_GATEWAY=1``."""
    programs = {os.path.basename(word) for word in (parent_cmdline or _parent_cmdline)().lower().split()}
    for word, name in GATEWAY_PROGRAMS.items():
        if word in programs or f"jupyter-{word}" in programs:
            return name
    if environ.get("KERNEL_GATEWAY") == "1":
        return "Jupyter Kernel Gateway"
    return None


def _parent_cmdline() -> str:
    try:
        return Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent_environ() -> dict[str, str]:
    """The environment the parent process (a gateway) was started with; empty where it cannot be read."""
    try:
        raw = Path(f"/proc/{os.getppid()}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def kernelspec_env(kernel_name: str) -> dict[str, str]:
    """The ``env`` of this host's kernelspec ``kernel_name`` (what the gateway's admin set), else empty."""
    if not kernel_name:
        return {}
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        env = KernelSpecManager().get_kernel_spec(kernel_name).env
    except Exception:  # noqa: BLE001 - no such kernelspec: nothing from it
        return {}
    return {str(k): str(v) for k, v in (env or {}).items()}


#: Where a gateway's environment lists the names of its own environment it passes to kernels.
GATEWAY_PROCESS_LISTS = ("KG_ENV_PROCESS_WHITELIST", "EG_INHERITED_ENVS", "EG_ENV_PROCESS_WHITELIST")


def keep_gateway_side_settings(
    environ: MutableMapping[str, str],
    gateway_environ: Mapping[str, str],
    spec_environ: Mapping[str, str],
    provisioned: bool,
) -> list[str]:
    """In a kernel a gateway started, take the pool's settings only from the gateway's side; return
    the names whose value came from the gateway's client (replaced or dropped).

    A gateway passes a kernel its client's ``KERNEL_*`` variables and the names its admin lets
    clients set (``KG_ENV_WHITELIST``, ``EG_CLIENT_ENVS``), beside its own environment's admitted
    names (``KG_ENV_PROCESS_WHITELIST``, ``EG_INHERITED_ENVS``) and the kernelspec's ``env``. Here a
    setting's value is the kernelspec's, else the gateway process's own where its environment admits
    that name (or the kernel already has that very value), else none: which pool, and whether to
    pool, is never the client's to say. ``provisioned``: the kernelspec names the pool's provisioner,
    which ran in the gateway and set this kernel's lease variables. After this hook re-executes the
    kernel (same pid), the lease variables it set itself stay; the lease they name is checked
    against the pool the gateway's side chose."""
    admitted = {
        name.strip() for listing in GATEWAY_PROCESS_LISTS for name in gateway_environ.get(listing, "").split(",") if name.strip()
    }
    pid, _, _ = environ.get(REEXEC_ENV, "").partition(":")
    own_reexec = pid == str(os.getpid())
    from_client = []
    for name in list(environ):
        if not (name.startswith("GPUPOOL_") or name in GATEWAY_GUARDED_ENV):
            continue
        value = environ[name]
        if name in spec_environ:
            trusted: str | None = spec_environ[name]
        elif name in gateway_environ and (name in admitted or value == gateway_environ[name]):
            trusted = gateway_environ[name]
        else:
            trusted = None
        if value == trusted:
            continue
        if trusted is None and name not in POOL_CHOICE_ENV and name not in GATEWAY_GUARDED_ENV and (own_reexec or provisioned):
            continue  # set by this hook before it re-executed, or by the pool's provisioner in the gateway
        from_client.append(name)
        if trusted is None:
            del environ[name]
        else:
            environ[name] = trusted
    return sorted(from_client)


def gateway_owner(environ: Mapping[str, str]) -> str:
    """Whom a gateway kernel's lease is charged to: the gateway's ``GPUPOOL_USER`` if its side set
    one, the client's ``KERNEL_USERNAME`` only where the gateway's side opted in
    (:data:`TRUST_USERNAME_ENV`), else the Unix user the gateway runs kernels as."""
    if environ.get("GPUPOOL_USER"):
        return environ["GPUPOOL_USER"]
    if environ.get(TRUST_USERNAME_ENV, "").strip().lower() in ("1", "true", "yes", "on") and environ.get("KERNEL_USERNAME"):
        return environ["KERNEL_USERNAME"]
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def stand_aside_reason(
    environ: Mapping[str, str],
    connection_file: str = "",
    has_gpu: Callable[[Mapping[str, str]], bool] = has_gpu_to_pool,
) -> str | None:
    """Why this kernel must be left alone, or None when it should lease from the pool.

    Cheapest checks first: a kernel on a host with no GPU costs two ``stat`` calls.
    """
    if opted_out(environ):
        return f"{AUTOLEASE_ENV}={environ.get(AUTOLEASE_ENV, '').strip()}"
    for name in PROVISIONED_ENV:
        if environ.get(name):
            return f"started by the pool's provisioner ({name} is set)"
    if environ.get("SLURM_JOB_ID"):
        return f"it runs in Slurm job {environ['SLURM_JOB_ID']}, whose GPUs Slurm allocated"
    if not has_gpu(environ):
        return "no NVIDIA driver on this host and no simulated pool"
    named = named_provisioner(kernel_name_of(connection_file))
    if named is not None and named not in OUR_PROVISIONERS:
        return f"its kernelspec names {named}"
    return None


@dataclass
class AutoLease:
    """The lease this kernel took for itself, and what it did to the environment."""

    environ: MutableMapping[str, str]
    lease_id: str | None = None
    #: Why the kernel runs CPU-only (None: it has, or waits for, a lease).
    cpu_only_reason: str | None = None
    queued: bool = False
    kernel_id: str = ""
    pool: Any = None
    shell: Any = None
    waiter: Any = None
    lines: list[str] = field(default_factory=list)  # every line said, in order (tests read it)
    #: The gateway that started this kernel (its lease follows the gateway's rules), else "".
    gateway: str = ""
    stream: Any = None
    #: ``NVIDIA_VISIBLE_DEVICES`` as the kernel found it (put back once it has a grant).
    container_devices: str | None = None
    #: Why the first cell must not run (its queued request ended while the kernel started), else None.
    first_cell_rejection: str | None = None

    def say(self, text: str) -> None:
        self.lines.append(text)
        say(text, self.stream)

    def tell_terminal(self, text: str) -> None:
        """One line on the terminal only (a waiting kernel's progress), not kept in :attr:`lines`."""
        say(text, self.stream)

    # --- at kernel start --------------------------------------------------------------------

    def start(self, label: str) -> None:
        """Hide every GPU, then lease from the pool; on any failure stay CPU-only, saying why."""
        from jupyter_gpupool.provisioner.kernel_provisioner import NO_GPU_ENV

        self.container_devices = self.environ.get("NVIDIA_VISIBLE_DEVICES")
        self.environ.update(NO_GPU_ENV)  # fail closed first: nothing below may leave a GPU visible
        if self.priority == "batch":
            start_wait(self.environ)  # a bad value is said once, here, whether or not the pool is full
        try:
            self._lease(label)
        except Exception as err:  # noqa: BLE001 - never break a kernel: CPU-only, one line
            from jupyter_gpupool.provisioner.kernel_provisioner import one_line

            self.cpu_only(one_line(err))

    def _lease(self, label: str) -> None:
        from jupyter_gpupool.backends.factory import selected_backend
        from jupyter_gpupool.core.models import LeaseRequest, LeaseState, PriorityClass
        from jupyter_gpupool.core.validate import usable_preferences
        from jupyter_gpupool.provisioner.kernel_provisioner import default_owner, holder_identity, pool_env, shared_pool

        if selected_backend(environ=self.environ) == "slurm":
            raise RuntimeError("kernels of a Slurm pool run as Slurm jobs: start this notebook with the gpupool kernelspec")
        pool = self.pool = self.pool or shared_pool()
        owner = gateway_owner(self.environ) if self.gateway else default_owner()
        prefs = usable_preferences(pool.preference(owner), owner)
        memory = pool.parse_memory(prefs["memory"]) if prefs.get("memory") else pool.default_memory()
        host, pid = holder_identity()
        request = LeaseRequest(
            owner=owner,
            memory=memory,
            kernel_id=self.kernel_id or None,
            num_gpus=int(prefs.get("num_gpus") or 1),
            model=prefs.get("model") or None,
            priority=PriorityClass(self.priority),
            holder_pid=pid,
            holder_host=host,
            label=label,
        )
        lease = pool.request(request)
        self.lease_id = lease.id
        atexit.register(self.release)
        self.environ.update(pool_env(pool))
        self.environ["GPUPOOL_LEASE_ID"] = lease.id
        self.environ["GPUPOOL_USER"] = lease.owner
        if lease.state is LeaseState.GRANTED:
            self.apply_grant(lease)
            return
        self.queued = True
        self.environ["GPUPOOL_ENFORCEMENT"] = "none"
        info = pool.queue_info(lease.id)
        where = f"position {info.position} of {info.length}" if info else "queued"
        self.say(
            f"this kernel waits for a GPU slice as {self.priority} ({where}, lease {lease.id}); "
            "it starts once the pool grants it, and the GPUs stay hidden until then"
        )

    @property
    def priority(self) -> str:
        """``batch`` (nobody started it from a server: a batch run below live users), or ``normal`` for a Voilà
        page's kernel (``VOILA_BASE_URL`` set) or a gateway kernel its server marked as started by a person."""
        hinted = self.gateway and self.environ.get(INTERACTIVE_HINT_ENV) == "1"
        return "normal" if hinted or "VOILA_BASE_URL" in self.environ else "batch"

    def apply_grant(self, lease: Any) -> None:
        """Put the grant's GPUs and caps into the environment (before CUDA has read it)."""
        from jupyter_gpupool.enforcement.plan import EnforcementSettings, plan_enforcement

        settings = EnforcementSettings().to_config()
        if settings.hami_library:  # LD_PRELOAD cannot reach a process that is already running
            from dataclasses import replace

            settings = replace(settings, hami_library=None)
        devices = {d.uuid: d for d in self.pool.devices()}
        plan = plan_enforcement(lease, devices, settings)
        self.environ.update(plan.env)
        if self.container_devices is None:
            self.environ.pop("NVIDIA_VISIBLE_DEVICES", None)
        else:
            self.environ["NVIDIA_VISIBLE_DEVICES"] = self.container_devices
        self.queued = False

    def cpu_only(self, reason: str) -> None:
        """Run without the pool: every GPU hidden, the reason where ``%gpupool status`` reads it."""
        from jupyter_gpupool.provisioner.kernel_provisioner import NO_GPU_ENV, UNAVAILABLE_ENV

        self.release("the kernel fell back to CPU-only")
        self.cpu_only_reason = reason
        self.queued = False  # nothing left to wait for: later cells run at once, CPU-only
        self.environ.update({**NO_GPU_ENV, "GPUPOOL_ENFORCEMENT": "none", UNAVAILABLE_ENV: reason})
        for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_MEMORY_LIMIT"):
            self.environ.pop(name, None)
        self.say(f"this kernel runs CPU-only (CUDA_VISIBLE_DEVICES=''): the GPU pool is unavailable: {reason}")

    def release_reason(self) -> str:
        """Why the pool released this kernel's lease ('' when it is live or cannot be read)."""
        try:
            lease = self.pool.get(self.lease_id) if self.pool is not None and self.lease_id else None
        except Exception:  # noqa: BLE001 - a label only
            return ""
        return str(getattr(lease, "release_reason", "") or "") if lease is not None and not lease.live else ""

    def release(self, reason: str = EXIT_REASON) -> None:
        """Give the lease back (at exit, or before falling back to CPU-only); never raises."""
        lease_id, self.lease_id = self.lease_id, None
        if not lease_id or self.pool is None:
            return
        try:
            self.pool.release(lease_id, reason=reason)
        except Exception:  # noqa: BLE001, S110 - the holder check or the heartbeat timeout frees it
            pass

    # --- once the shell exists --------------------------------------------------------------

    def on_shell(self, shell: Any) -> None:
        """Load the kernel extension, and the first-cell wait while queued (never raises)."""
        if shell is None or self.shell is shell:
            return
        self.shell = shell
        self.release_on_shutdown_request(getattr(shell, "kernel", None))
        try:
            shell.extension_manager.load_extension(KERNEL_EXTENSION)
        except Exception as err:  # noqa: BLE001
            self.say(f"could not load {KERNEL_EXTENSION} (%gpupool and the framework caps): {err}")
        if self.queued or self.first_cell_rejection:
            from jupyter_gpupool.kernel.first_cell_wait import FirstCellWait

            self.waiter = FirstCellWait(self)
            self.waiter.start(shell)

    def release_on_shutdown_request(self, kernel: Any) -> None:
        """Give the lease back when the kernel is asked to shut down, before it replies. Its manager
        terminates a kernel slow to exit (jupyter_client: SIGTERM after half its
        ``shutdown_wait_time``, a thread left running is enough), and a terminated process runs no
        atexit handler. A restart leases again in the new process."""
        original = getattr(kernel, "do_shutdown", None)
        if original is None or getattr(original, "_gives_lease_back", False):
            return

        async def do_shutdown(restart: bool) -> Any:
            self.release()
            reply = original(restart)
            return await reply if inspect.isawaitable(reply) else reply

        do_shutdown._gives_lease_back = True  # type: ignore[attr-defined]
        kernel.do_shutdown = do_shutdown

    def wait_before_answering(self, bound: float, parent: int | None = None) -> None:
        """Wait for the queued lease, until ``bound`` seconds after this process started, before the
        kernel binds its sockets.

        Its client is then in its start (jupyter_client's ``wait_for_ready``), which every client
        bounds by a start timeout of its own (60 s by default) and never by a per-cell or per-run
        deadline. Granted: the kernel starts with its GPUs. Still queued at ``bound``: it starts,
        and its first cell waits. Its request ended: CPU-only, and the first cell says why. Its
        client (the parent process, ``parent``) gone: the request is withdrawn and the kernel exits.
        """
        from jupyter_gpupool.errors import GpuPoolError
        from jupyter_gpupool.units import format_duration

        if bound <= 0 or not self.queued or not self.lease_id or self.pool is None:
            return
        parent = os.getppid() if parent is None else parent
        started = time.monotonic()
        deadline = started + bound - _process_age()
        last = [""]

        def on_update(lease: Any, info: Any) -> None:
            from jupyter_gpupool.kernel.first_cell_wait import waiting_line

            text = waiting_line(self.priority, info)
            if text != last[0]:
                last[0] = text
                self.say(text)

        on_update(None, self.pool.queue_info(self.lease_id))
        while self.queued:
            if os.getppid() != parent:
                self.release(CLIENT_LEFT_REASON)
                self.say(f"{CLIENT_LEFT_REASON}: its request is withdrawn and the kernel exits")
                os._exit(0)
            left = deadline - time.monotonic()
            if left <= 0:
                self.say(
                    f"still queued {format_duration(bound)} after the kernel started: it answers its client now, before the "
                    f"client's start timeout, and its first cell waits for the grant ({START_WAIT_ENV} sets how long a start waits)"
                )
                return
            try:
                lease = self.pool.wait_for_grant(self.lease_id, timeout=min(1.0, left), on_update=on_update)
            except (TimeoutError, KeyboardInterrupt):  # nothing to interrupt before the kernel has started
                continue
            except GpuPoolError as err:
                why = self.release_reason() or str(err)
                self.cpu_only(f"its queued GPU request ended: {why}")
                self.first_cell_rejection = f"no GPU slice for this kernel (its queued request ended: {why}); it runs CPU-only from now on"
                return
            self.apply_grant(lease)
            devices = self.environ.get("CUDA_VISIBLE_DEVICES", "")
            self.say(f"granted after {format_duration(time.monotonic() - started)}: CUDA_VISIBLE_DEVICES={devices}")

    def wait_for_grant(self, on_update: Callable[[Any, Any], None] | None = None) -> None:
        """Block until the queued lease is granted, then apply it (the kernel client re-caps the frameworks)."""
        from jupyter_gpupool import kernel

        client = kernel.get_client()
        lease = client.wait_for_grant(on_update=on_update)
        self.apply_grant(lease)


def _process_age() -> float:
    """Seconds since this process started (0 where it cannot be told); a re-executed kernel keeps its start."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil, or no /proc: count from now
        return 0.0


def _starter_label(kernel_name: str) -> str:
    """``python3 kernel of jupyter-nbconvert`` (the parent's program), shown with the lease."""
    parent = ""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
        words = [os.path.basename(w.decode(errors="replace")) for w in raw if w]
        if words and words[0].startswith("python") and len(words) > 1:
            words = words[1:]
            if words[0] == "-m" and len(words) > 1:
                words = words[1:]
        parent = words[0] if words else ""
    except OSError:
        pass
    kernel = kernel_name or "IPython"
    return f"{kernel} kernel of {parent}" if parent else f"{kernel} kernel (started without the pool's provisioner)"


def _kernel_id_from(connection_file: str) -> str:
    """``kernel-<id>.json`` → ``<id>`` (jupyter_client's naming), else ''."""
    stem = Path(connection_file).stem if connection_file else ""
    return stem.removeprefix("kernel-") if stem.startswith("kernel-") else ""


def mark_unpooled_kernelspecs(kernel_spec_manager: Any, default_provisioner: str) -> None:
    """An admin's opt-out reaches the kernel: a server's kernelspec that no provisioner of ours
    starts (it names another, or names none while ``default_provisioner`` is not ours) gets
    ``GPUPOOL_AUTOLEASE=off`` in its ``env``, so :func:`configure` in its kernel stands aside."""
    original = kernel_spec_manager.get_kernel_spec

    def get_kernel_spec(kernel_name: str, *args: Any, **kwargs: Any) -> Any:
        spec = original(kernel_name, *args, **kwargs)
        metadata = spec.metadata if isinstance(spec.metadata, dict) else {}
        section = metadata.get("kernel_provisioner")
        named = section.get("provisioner_name") if isinstance(section, dict) else None
        if (named or default_provisioner) not in OUR_PROVISIONERS:
            spec.env = {**(spec.env or {}), AUTOLEASE_ENV: "off"}
        return spec

    kernel_spec_manager.get_kernel_spec = get_kernel_spec


_current: dict[str, AutoLease] = {}


def current() -> AutoLease | None:
    """The lease this process took for itself, if it took one."""
    return _current.get("lease")


def configure(config: Any = None, app: Any = None, environ: MutableMapping[str, str] | None = None) -> AutoLease | None:
    """Called from ``ipython_kernel_config.py``: lease for this kernel unless it must be left alone.

    ``app`` is the kernel application (found as the IPKernelApp singleton when not given). Returns
    what was done, or None when it stood aside. Never raises.
    """
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    if "lease" in _current:  # the config file is read once per process; a second call changes nothing
        return _current["lease"]
    keep_terminal()  # before the kernel app takes stderr over
    try:
        if app is None:
            from ipykernel.kernelapp import IPKernelApp

            app = IPKernelApp.instance() if IPKernelApp.initialized() else None
        connection_file = str(getattr(app, "connection_file", "") or "")
        gateway = gateway_of(env)
        if gateway is not None:
            kernel_name = kernel_name_of(connection_file)
            provisioned = named_provisioner(kernel_name) in OUR_PROVISIONERS
            dropped = keep_gateway_side_settings(env, _parent_environ(), kernelspec_env(kernel_name), provisioned)
            if dropped:
                say(
                    f"ignored {', '.join(dropped)} from the {gateway}'s client: a gateway kernel is pooled by the "
                    "settings of the gateway's host (its environment or this kernelspec), never by its client"
                )
        held = _held_before_exec(env, gateway or "", connection_file)
        if held is not None:  # this process leased, then re-executed itself: carry on with that lease
            auto = _current["lease"] = held
            _load_extension_with_shell(auto, app, config)
            return auto
        reason = stand_aside_reason(env, connection_file)
        if reason is not None:
            if not any(env.get(name) for name in PROVISIONED_ENV):  # the provisioner's kernels load the extension
                _say_why_with_shell(app, reason)
            return None
    except Exception as err:  # noqa: BLE001 - deciding failed: fail closed, without the pool
        from jupyter_gpupool.provisioner.kernel_provisioner import NO_GPU_ENV

        env.update(NO_GPU_ENV)
        say(f"this kernel runs CPU-only (CUDA_VISIBLE_DEVICES=''): cannot tell whether to lease from the GPU pool: {err}")
        return None
    kernel_name = kernel_name_of(connection_file)
    auto = _current["lease"] = AutoLease(environ=env, kernel_id=_kernel_id_from(connection_file), gateway=gateway or "")
    auto.start(_starter_label(kernel_name))
    if auto.lease_id and environ is None:
        _reexec_with_lease(auto)  # returns only where it cannot
    _load_extension_with_shell(auto, app, config)
    return auto


def _reexec_with_lease(auto: AutoLease) -> None:
    """Run this kernel again, same pid, with its lease in the environment it starts with.

    What ``/proc/<pid>/environ`` shows is the environment a process was started with, and that is
    where the pool's watcher finds which lease a GPU process belongs to: without it, this kernel's
    memory would count as used outside the pool. The kernel has bound no socket yet, and the
    lease is held by this pid, which ``execve`` keeps. Where the broker runs device control, a
    granted kernel re-executes through ``device_join``: it runs again once its GPU opens to it."""
    if os.name != "posix" or not getattr(sys, "orig_argv", None):
        return
    auto.environ[REEXEC_ENV] = f"{os.getpid()}:{auto.lease_id}:{'queued' if auto.queued else 'granted'}:{os.getppid()}"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - nothing to flush
            pass
    argv = list(sys.orig_argv)
    if not auto.queued and _device_control_runs(auto.pool):
        # The broker opens this kernel's GPU once it finds the process naming its lease: wait for
        # that before the kernel runs again, so its first CUDA call never meets EPERM.
        from jupyter_gpupool.enforcement.device_join import join_command

        argv = join_command(argv, sys.executable)
    try:
        os.execve(sys.executable, argv, dict(auto.environ))
    except OSError as err:
        auto.environ.pop(REEXEC_ENV, None)
        auto.say(f"could not restart this kernel with its lease in its environment ({err}); the pool may count its GPU memory as outside the pool")


def _device_control_runs(pool: Any) -> bool:
    """Whether the pool's broker denies GPU nodes outside granted kernels (its info says so)."""
    from jupyter_gpupool.provisioner.kernel_provisioner import device_control_runs

    return device_control_runs(pool)


def _held_before_exec(env: MutableMapping[str, str], gateway: str = "", connection_file: str = "") -> AutoLease | None:
    """The lease this very process took before it re-executed itself, else None (a child kernel
    inherits the variable with another pid, and stands aside: it shares its parent's slice). A
    queued lease waits here, with the kernel's ports held (``connection_file``'s) until it binds them."""
    pid, _, rest = env.get(REEXEC_ENV, "").partition(":")
    lease_id, _, rest = rest.partition(":")
    was, _, parent = rest.partition(":")
    if pid != str(os.getpid()) or not lease_id or env.get("GPUPOOL_LEASE_ID") != lease_id:
        return None
    from jupyter_gpupool.core.models import LeaseState
    from jupyter_gpupool.kernel.ports import ports_held
    from jupyter_gpupool.provisioner.kernel_provisioner import shared_pool

    auto = AutoLease(environ=env, lease_id=lease_id, gateway=gateway)
    atexit.register(auto.release)
    try:
        auto.pool = shared_pool()
        lease = auto.pool.get(lease_id)
        if lease.holder_pid not in (None, os.getpid()):
            raise RuntimeError(f"lease {lease_id} is not this kernel's (held by pid {lease.holder_pid})")
        if lease.state is LeaseState.GRANTED:  # granted while the kernel restarted: the GPUs it holds now
            auto.apply_grant(lease)
            if was == "queued":
                auto.say(f"granted while the kernel started: CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')}")
        elif lease.state is LeaseState.QUEUED:
            auto.queued = True
        else:
            auto.cpu_only(f"its GPU lease was released while the kernel started ({lease.release_reason or 'released'})")
    except Exception as err:  # noqa: BLE001 - never break the kernel: CPU-only, one line
        from jupyter_gpupool.provisioner.kernel_provisioner import one_line

        auto.cpu_only(one_line(err))
    if auto.queued:
        # A person's notebook behind a gateway shows the wait in its first cell (its client has no
        # per-cell deadline); a scripted client's start timeout bounds a wait before it is answered.
        bound = 0.0 if auto.priority == "normal" else start_wait(env, quiet=True)
        try:
            with ports_held(connection_file):
                auto.wait_before_answering(bound, int(parent) if parent.isdigit() else None)
        except Exception as err:  # noqa: BLE001 - the wait goes on in the first cell
            auto.say(f"could not wait for the GPU before the kernel started ({err}); its first cell waits")
    return auto


def _say_why_with_shell(app: Any, reason: str) -> None:
    """Give a kernel that stands aside a ``%gpupool`` that prints one line saying why, so a notebook
    with ``%gpupool`` lines runs where there is no pool. Nothing of the pool is imported."""
    if app is None or not hasattr(app, "observe"):
        return
    line = f"gpupool: this kernel runs without the GPU pool: {reason}"

    def gpupool(_line: str = "") -> None:
        print(line)

    def register(change: Any) -> None:
        shell = change["new"]
        try:
            if "gpupool" not in shell.magics_manager.magics["line"]:
                shell.register_magic_function(gpupool, magic_kind="line", magic_name="gpupool")
        except Exception:  # noqa: BLE001, S110 - a shell that refuses it: %gpupool stays unknown
            pass

    app.observe(register, names="shell")


def _load_extension_with_shell(auto: AutoLease, app: Any, config: Any) -> None:
    """Load the extension the moment the kernel app creates its shell (before extensions and
    startup files run); without an app, through the config's extension list."""
    if app is not None and hasattr(app, "observe"):
        app.observe(lambda change: auto.on_shell(change["new"]), names="shell")
        return
    if config is not None:
        try:
            config.InteractiveShellApp.extensions.append(KERNEL_EXTENSION)
        except Exception:  # noqa: BLE001, S110 - a config that refuses it: the kernel runs without %gpupool
            pass


__all__ = [
    "AUTOLEASE_ENV",
    "AutoLease",
    "configure",
    "current",
    "gateway_of",
    "gateway_owner",
    "has_gpu_to_pool",
    "keep_gateway_side_settings",
    "kernel_name_of",
    "mark_unpooled_kernelspecs",
    "named_provisioner",
    "opted_out",
    "stand_aside_reason",
    "start_wait",
]
