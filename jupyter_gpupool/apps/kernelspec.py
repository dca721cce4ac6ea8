"""``jupyter gpupool kernelspec install``: kernelspecs with a fixed GPU slice.

A teacher offers "small" and "large" GPU kernels in the launcher::

    jupyter gpupool kernelspec install --name python3-gpu-4g --memory 4GiB --sys-prefix
    jupyter gpupool kernelspec install --name python3-gpu-16g --memory 16GiB --sys-prefix

Each copies an existing kernelspec (``python3`` by default) and sets its provisioner to
``gpupool-provisioner`` with the slice in the provisioner's config. A slice the pool this host is
configured for could never grant (the broker's with ``GPUPOOL_URL``, else the simulated or NVML
GPUs; judged by the engine's own rules, so one larger than a GPU may span several) is refused
with exit code 3; with no pool to ask, it is installed with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_core.application import JupyterApp
from traitlets import Bool, Unicode

from jupyter_gpupool.application import GpuPoolBaseApp
from jupyter_gpupool.backends.discovery import find_broker
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core import validate
from jupyter_gpupool.core.engine import Engine
from jupyter_gpupool.core.models import Device, LeaseRequest, PriorityClass, model_matches
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices import make_backend
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB, SIZE_FORMS, format_size, parse_size

PROVISIONER_NAME = "gpupool-provisioner"
_NAME_RE = re.compile(r"^[a-zA-Z0-9._-]+$")


def gpu_kernelspec(base: dict[str, Any], memory: str, num_gpus: int = 1, priority: str = "", model: str = "",
                   display_name: str = "", limit: str = "") -> dict[str, Any]:
    """A copy of ``base`` (a kernel.json dict) whose kernels are guaranteed a GPU slice of ``memory``
    and may grow to ``limit`` while the GPU has room (``0``: a fixed slice; empty: the pool's burst)."""
    size = parse_size(memory, gpu_memory=GIB)  # validate early: "25%" is fine, "8XB" is not
    validate.slice_floor(memory, "--memory {}")
    if num_gpus < 1:
        raise InvalidInput(f"--gpus must be at least 1, got {num_gpus}")
    if priority and priority not in {c.value for c in PriorityClass}:
        raise InvalidInput(f"--priority must be batch, normal or high, got {priority!r}")
    if limit and limit.strip() != "0":
        ceiling = parse_size(limit, gpu_memory=GIB)
        validate.slice_floor(limit, "--limit {}")
        if not memory.strip().endswith("%") and not limit.strip().endswith("%") and ceiling < size:
            raise InvalidInput(f"--limit {limit.strip()} is below --memory {memory.strip()}; give a limit of at least the size, or 0 for a fixed slice")
    spec = json.loads(json.dumps(base))
    config: dict[str, Any] = {"memory": memory}
    if limit:
        config["limit"] = limit.strip()
    if num_gpus != 1:
        config["num_gpus"] = num_gpus
    if priority:
        config["priority"] = priority
    if model:
        config["model"] = model
    metadata = spec.setdefault("metadata", {})
    metadata["kernel_provisioner"] = {"provisioner_name": PROVISIONER_NAME, "config": config}
    gpus = f"{num_gpus}x " if num_gpus != 1 else ""
    up_to = f", up to {limit.strip()}" if limit and limit.strip() != "0" else ""
    spec["display_name"] = display_name or f"{base.get('display_name', 'Kernel')} (GPU {gpus}{memory}{up_to})"
    return spec


class KernelSpecInstallApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-kernelspec-install"
    description = "Install a kernelspec whose kernels get a fixed GPU slice."
    aliases = {
        **GpuPoolBaseApp.aliases,
        "name": "KernelSpecInstallApp.kernel_name",
        "display-name": "KernelSpecInstallApp.display_name",
        "memory": "KernelSpecInstallApp.memory",
        "limit": "KernelSpecInstallApp.limit",
        "gpus": "KernelSpecInstallApp.gpus",
        "priority": "KernelSpecInstallApp.priority",
        "model": "KernelSpecInstallApp.model",
        "kernel": "KernelSpecInstallApp.base_kernel",
        "prefix": "KernelSpecInstallApp.prefix",
    }
    flags = {
        **GpuPoolBaseApp.flags,
        "user": ({"KernelSpecInstallApp": {"user": True}}, "Install for the current user only."),
        "sys-prefix": ({"KernelSpecInstallApp": {"prefix": sys.prefix}}, f"Install into {sys.prefix}."),
        "replace": ({"KernelSpecInstallApp": {"replace": True}}, "Replace an existing kernelspec of that name."),
    }

    kernel_name = Unicode("", help="Name of the new kernelspec, e.g. python3-gpu-8g.").tag(config=True)
    display_name = Unicode("", help="Name shown in the launcher (default: the base's name plus the slice).").tag(config=True)
    memory = Unicode("", help=f"GPU slice its kernels are guaranteed: {SIZE_FORMS}.").tag(config=True)
    limit = Unicode(
        "",
        help=f"How far its kernels' slices may grow above --memory while the GPU has room: {SIZE_FORMS}; 0 for a "
        "fixed slice (default: the pool's c.PoolPolicy.burst).",
    ).tag(config=True)
    gpus = Unicode("1", help="Number of GPUs per kernel.").tag(config=True)
    priority = Unicode("", help="Priority class of its kernels: batch (e.g. autograding), normal or high.").tag(config=True)
    model = Unicode("", help="GPU model its kernels need, e.g. A100 (default: any).").tag(config=True)
    base_kernel = Unicode("python3", help="Kernelspec to copy (argv, language, logos).").tag(config=True)
    prefix = Unicode("", help="Install under this prefix (e.g. sys.prefix) instead of system-wide.").tag(config=True)
    user = Bool(False, help="Install for the current user only.").tag(config=True)
    replace = Bool(False, help="Replace an existing kernelspec of that name.").tag(config=True)

    def run(self) -> None:
        if not self.kernel_name or not _NAME_RE.match(self.kernel_name):
            raise InvalidInput("give --name with letters, digits, '.', '_' or '-', e.g. --name python3-gpu-8g")
        if not self.memory:
            raise InvalidInput(f"give --memory: {SIZE_FORMS}")
        if not self.gpus.isdigit():
            raise InvalidInput(f"--gpus must be a whole number like 2, got {self.gpus!r}")
        # jupyter_client logs its own "Installed kernelspec ..." and path warning: this command
        # says each once, in its own words.
        quiet = logging.getLogger("jupyter_gpupool.apps.kernelspec.install")
        quiet.setLevel(logging.ERROR)
        manager = KernelSpecManager(log=quiet)
        try:
            base = manager.get_kernel_spec(self.base_kernel)
        except NoSuchKernel:
            names = ", ".join(sorted(manager.find_kernel_specs()))
            raise InvalidInput(f"no kernelspec {self.base_kernel!r} to copy; installed: {names}") from None
        spec = gpu_kernelspec(base.to_dict(), self.memory, int(self.gpus), self.priority, self.model, self.display_name,
                              self.limit)
        self.check_fits_the_pool(int(self.gpus))
        target = manager._get_destination_dir(self.kernel_name, user=self.user, prefix=self.prefix or None)
        if not self.replace and (os.path.exists(target) or self.kernel_name in manager.find_kernel_specs()):
            raise InvalidInput(f"a kernelspec named {self.kernel_name!r} exists; add --replace to overwrite it")
        with tempfile.TemporaryDirectory() as staging:
            for item in os.listdir(base.resource_dir):
                if item != "kernel.json":
                    source = os.path.join(base.resource_dir, item)
                    if os.path.isfile(source):
                        shutil.copy(source, staging)
            with open(os.path.join(staging, "kernel.json"), "w") as handle:
                json.dump(spec, handle, indent=1)
            destination = manager.install_kernel_spec(
                staging, self.kernel_name, user=self.user, prefix=self.prefix or None, replace=True
            )
        kernel_dirs = {os.path.realpath(path) for path in manager.kernel_dirs}
        if os.path.realpath(os.path.dirname(destination)) not in kernel_dirs:
            print(f"jupyter gpupool kernelspec install: warning: {os.path.dirname(destination)} is not on Jupyter's kernel path, "
                  "so Jupyter will not list this kernel; add its share/jupyter folder to JUPYTER_PATH, or use --user or --sys-prefix",
                  file=sys.stderr)
        self.emit({"name": self.kernel_name, "path": destination, "spec": spec}, f"installed {spec['display_name']!r} in {destination}")


    def pool_devices(self) -> tuple[list[Device] | None, Any, str]:
        """The devices and policy of the pool this host is configured for (the broker's with GPUPOOL_URL
        or this host's discovery file, else the simulated or NVML inventory and the local policy), and
        where they come from; ``None`` and why when none can be read. Opens no pool file: installing a
        kernelspec must not create one."""
        env = dict(os.environ)
        if self.simulate:
            env["GPUPOOL_SIMULATE"] = self.simulate
        try:
            if self.discover_broker:  # this host's broker: its GPUs, never NVML here (device control may deny them)
                found = find_broker(
                    env, on_ignored=lambda why: print(f"jupyter gpupool kernelspec install: warning: {why}", file=sys.stderr)
                )
                if found is not None:
                    env["GPUPOOL_URL"] = found.url
            if (env.get("GPUPOOL_URL") or "").strip():
                env.setdefault("GPUPOOL_TIMEOUT", "10")
                remote = RemotePool.from_env(env)
                return remote.devices(), remote.policy, f"the broker at {remote.url}"
            backend = make_backend(env.get("GPUPOOL_SIMULATE") or None)
            try:
                policy = PoolPolicy(config=self.config)
                policy.apply_env(env)
                devices = [
                    Device(**{**d.__dict__, "overcommit": policy.overcommit_for(d.uuid, d.index)}) for d in backend.devices()
                ]
            finally:
                backend.close()
            return devices, policy, backend.describe()
        except (GpuPoolError, OSError) as err:
            return None, None, str(err)

    def check_fits_the_pool(self, num_gpus: int) -> None:
        """Refuse (exit 3) a slice the pool would refuse as never fitting, by the engine's own rules (a
        slice larger than one GPU may span several); warn, and go on, when no pool can be read."""
        devices, policy, source = self.pool_devices()
        if devices is None:
            print(f"jupyter gpupool kernelspec install: warning: --memory {self.memory} could not be checked against a GPU "
                  f"pool ({source}); installing it unchecked", file=sys.stderr)
            return
        candidates = [d for d in devices if d.healthy and (not self.model or model_matches(self.model, d))]
        if not candidates and not self.model and devices:  # every GPU unhealthy, or not open to this process
            reasons = "; ".join(f"GPU {d.index}: {d.health_reason}" for d in devices)
            raise RequestRefused(f"no healthy GPU in {source} ({reasons})")
        if not candidates:
            models = ", ".join(sorted({d.model for d in devices})) or "none"
            raise RequestRefused(f"no GPU of model {self.model!r} in {source}; models here: {models}")
        largest = max(candidates, key=lambda d: d.leasable)
        memory = parse_size(self.memory, gpu_memory=largest.memory_total)
        request = LeaseRequest(owner="kernelspec", memory=memory, num_gpus=num_gpus, model=self.model or None)
        try:
            per_gpu, gpus = Engine(policy)._shape(request, candidates)
        except RequestRefused as err:
            raise RequestRefused(
                f"--memory {self.memory}{f' --gpus {num_gpus}' if num_gpus != 1 else ''} never fits {source}: {err} "
                f"(the largest GPU{' of model ' + self.model if self.model else ''}, GPU {largest.index} ({largest.name}), "
                f"has {format_size(largest.leasable)})"
            ) from None
        if gpus != num_gpus:
            print(f"jupyter gpupool kernelspec install: note: --memory {self.memory} is more than GPU {largest.index} "
                  f"({largest.name}, {format_size(largest.leasable)}) holds, so its kernels span {gpus} GPUs of "
                  f"{source}, {format_size(per_gpu)} each", file=sys.stderr)


class KernelSpecApp(JupyterApp):
    name = "jupyter-gpupool-kernelspec"
    description = "Manage GPU kernelspecs: jupyter gpupool kernelspec install --name NAME --memory 8GiB"
    subcommands = {"install": (KernelSpecInstallApp, KernelSpecInstallApp.description)}
    subcommand_description = "For the options of a subcommand: jupyter gpupool kernelspec SUBCOMMAND --help."

    def start(self) -> None:
        if self.subapp is None:
            print("usage: jupyter gpupool kernelspec install --name NAME --memory 8GiB [--gpus N] [--priority batch] "
                  "[--user | --sys-prefix | --prefix P] [--replace]")
            self.exit(2 if self.extra_args else 0)
            return
        self.subapp.start()
