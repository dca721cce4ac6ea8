"""``jupyter gpupool demo``: JupyterLab on a simulated pool, with a notebook that shows a grant,
a queue and an idle reclaim. The main job on a machine without a GPU (and on Binder)."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Any

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook
from traitlets import Bool, Integer, Unicode

from jupyter_gpupool.application import GpuPoolBaseApp
from jupyter_gpupool.devices.simulated import parse_inventory
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB, MIB, format_size, parse_duration, parse_size

DEMO_NOTEBOOK = "gpupool-demo.ipynb"
#: The demo's default slice is this share of its smallest GPU, so every GPU holds a few slices
#: and the notebook's story (a grant, classmates filling the pool, a queue, a reclaim) works on any ``--gpus``.
DEFAULT_SLICE_SHARE = 4


def default_slice(inventory: str) -> str:
    """A quarter of the smallest simulated GPU, rounded down to 256 MiB: ``"4GiB"`` for ``1x16GiB``."""
    smallest = min(memory for _, memory in parse_inventory(inventory))
    size = max(256 * MIB, smallest // DEFAULT_SLICE_SHARE // (256 * MIB) * (256 * MIB))
    return f"{size // GIB}GiB" if size % GIB == 0 else f"{size // MIB}MiB"


#: What the demo's server decides with: a command given the same decides the same way.
DEMO_POLICY_ENV = ("GPUPOOL_DB", "GPUPOOL_SIMULATE", "GPUPOOL_DEFAULT_MEMORY", "GPUPOOL_IDLE_TIMEOUT", "GPUPOOL_WARNING_PERIOD")


def cli_hint(env: dict[str, str]) -> str:
    """The shell line that points ``jupyter gpupool`` at the demo's pool, under the demo's policy
    (every process that shares a pool file decides with its own policy: a command given only the
    file would warn the demo's idle kernels on the default policy's clock)."""
    return " ".join(f"{name}={shlex.quote(env[name])}" for name in DEMO_POLICY_ENV) + " jupyter gpupool status"


def demo_notebook() -> Any:
    """The demo notebook: this kernel's slice, classmates filling the pool, a queue, a reclaim."""
    cells = [
        new_markdown_cell(
            "# jupyter-gpupool demo\n\n"
            "This JupyterLab runs on a **simulated** GPU pool (no GPU needed). Every kernel you start gets a "
            "slice of a GPU; when the pool is full, kernels wait in a queue; idle slices go back while others wait.\n\n"
            "Open the **GPU pool** panel in the right sidebar (the chip icon) and watch the status bar."
        ),
        new_markdown_cell("## 1. A grant: this kernel's slice"),
        new_code_cell("%gpupool status"),
        new_code_cell("from jupyter_gpupool.widget import PoolStatus\nPoolStatus()"),
        new_markdown_cell(
            "The pool is simulated, so this kernel *pretends* to hold GPU memory (on a real GPU, PyTorch or JAX "
            "would). Within a few seconds the watchdog sees it: the panel's usage bar moves, and since the peak is "
            "far below the slice it suggests shrinking it."
        ),
        new_code_cell(
            "import os\n"
            "from jupyter_gpupool.devices.simulated import pretend_to_use\n"
            "slice_bytes = int(os.environ.get('GPUPOOL_MEMORY_LIMIT', 12 * 2**30))  # set in a kernel holding a slice\n"
            "pretend_to_use(min(3 * 2**30, slice_bytes // 4))  # 3 GiB, or a quarter of a smaller slice"
        ),
        new_markdown_cell(
            "## 2. Classmates fill the pool\n\nThese leases stand in for other users' kernels. They never run code, "
            "so they count as idle."
        ),
        new_code_cell(
            "from jupyter_gpupool.core.models import LeaseRequest\n"
            "from jupyter_gpupool.backends.local.pool import Pool\n\n"
            "pool = Pool.from_env()\n"
            "free = sum(d.leasable for d in pool.devices()) - sum(l.memory * l.num_gpus for l in pool.leases() if l.state.value == 'granted')\n"
            "size = pool.default_memory()\n"
            "classmates = []\n"
            "for i in range(int(free // size)):\n"
            "    classmates.append(pool.request(LeaseRequest(owner=f'classmate-{i}', memory=size, duration=3600, label='demo')))\n"
            "print(f'{len(classmates)} classmates hold {len(classmates) * size / 2**30:.0f} GiB')\n"
            "%gpupool status"
        ),
        new_markdown_cell(
            "## 3. A queue\n\nOne more classmate asks for a slice: the pool is full, so the request waits. "
            "Open a second notebook now and its kernel will queue too: the status bar says `GPU queued #k`."
        ),
        new_code_cell("late = pool.request(LeaseRequest(owner='late-student', memory=size, duration=3600, label='demo'))\n"
                      "print(late.state, pool.queue_info(late.id))\n%gpupool queue"),
        new_markdown_cell(
            "## 4. An idle reclaim\n\nThe classmates have been idle longer than the demo's idle timeout, and someone "
            "waits: the pool warns the longest-idle lease, then reclaims it after the warning period, and the queued "
            "request gets its slice. (This kernel stays busy while the cell runs, so its own slice is safe; click "
            "**Keep** in the panel to protect it while idle.)"
        ),
        new_code_cell(
            "import time\n"
            "from jupyter_gpupool.units import format_duration\n"
            "deadline = time.time() + 600\n"
            "while pool.get(late.id).state.value == 'queued' and time.time() < deadline:\n"
            "    pool.tick()\n"
            "    warned = [l for l in pool.leases() if l.reclaim_at]\n"
            "    print('\\r' + (f'{warned[0].owner} warned: reclaim in {format_duration(warned[0].reclaim_at - time.time())}' if warned else 'waiting for an idle slice...'), end='')\n"
            "    time.sleep(2)\n"
            "print()\n"
            "reclaimed = [l for l in pool.leases(include_released=True) if l.release_reason.startswith('reclaimed')]\n"
            "for lease in reclaimed:\n"
            "    print(f'{lease.owner}: {lease.release_reason}')\n"
            "print('late-student is now', pool.get(late.id).state)"
        ),
        new_markdown_cell("## 5. Metering\n\nGiB·hours held and active per user, as admins see them:"),
        new_code_cell("!jupyter gpupool report --by user"),
        new_markdown_cell("## Clean up"),
        new_code_cell("for lease in classmates + [late]:\n    pool.release(lease.id, reason='demo finished')\n%gpupool status"),
    ]
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    return notebook


class DemoApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-demo"
    description = "Start JupyterLab on a simulated GPU pool with a demo notebook (no GPU needed)."
    aliases = {
        **GpuPoolBaseApp.aliases,
        "gpus": "DemoApp.gpus",
        "default-memory": "DemoApp.default_memory",
        "idle-timeout": "DemoApp.idle_timeout",
        "warning-period": "DemoApp.warning_period",
        "dir": "DemoApp.directory",
        "port": "DemoApp.port",
        "ip": "DemoApp.ip",
    }
    flags = {
        **GpuPoolBaseApp.flags,
        "no-browser": ({"DemoApp": {"open_browser": False}}, "Do not open a browser."),
        "dry-run": ({"DemoApp": {"dry_run": True}}, "Prepare the demo folder and print the command, without starting JupyterLab."),
    }

    gpus = Unicode("2xA100-80GB", help="Simulated inventory, e.g. 1x16GiB or 4xRTX3090-24GB.").tag(config=True)
    default_memory = Unicode(
        "", help="Slice each kernel gets by default, e.g. 4GiB or 25%. Empty: a quarter of the smallest GPU (20GiB on 2xA100-80GB)."
    ).tag(config=True)
    idle_timeout = Unicode("60s", help="Idle time before a slice may be reclaimed (short, for the demo).").tag(config=True)
    warning_period = Unicode("20s", help="Warning before an idle slice is reclaimed.").tag(config=True)
    directory = Unicode("", help="Folder for the demo notebook and pool file (default: ./gpupool-demo).").tag(config=True)
    port = Integer(0, help="Port for JupyterLab (0: its default).").tag(config=True)
    ip = Unicode("", help="Interface for JupyterLab (e.g. 0.0.0.0 in a container).").tag(config=True)
    open_browser = Bool(True, help="Open a browser tab.").tag(config=True)
    dry_run = Bool(False, help="Prepare everything and print the command instead of starting JupyterLab.").tag(config=True)

    def prepare(self) -> tuple[list[str], dict[str, str], str]:
        """Validate options, write the notebook; return (command, environment, folder)."""
        inventory = self.simulate or self.gpus
        gpus = parse_inventory(inventory)
        default_memory = self.default_memory or default_slice(inventory)
        largest = max(memory for _, memory in gpus)
        if parse_size(default_memory, gpu_memory=largest) > largest:
            raise RequestRefused(
                f"--default-memory {default_memory} is larger than the largest GPU of {inventory} ({format_size(largest)}), "
                f"so no kernel could start; leave it out for {default_slice(inventory)} or ask for at most {format_size(largest)}"
            )
        parse_duration(self.idle_timeout)
        parse_duration(self.warning_period)
        if not 0 <= self.port < 65536:
            raise InvalidInput(f"--port must be between 1 and 65535, got {self.port}")
        folder = os.path.abspath(self.directory or "gpupool-demo")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, DEMO_NOTEBOOK)
        if not os.path.exists(path):
            nbformat.write(demo_notebook(), path)
        env = {
            **os.environ,
            "GPUPOOL_SIMULATE": inventory,
            "GPUPOOL_DB": self.db or os.path.join(folder, ".gpupool.sqlite"),
            "GPUPOOL_DEFAULT_MEMORY": default_memory,
            "GPUPOOL_IDLE_TIMEOUT": self.idle_timeout,
            "GPUPOOL_WARNING_PERIOD": self.warning_period,
        }
        jupyter = shutil.which("jupyter") or "jupyter"
        command = [jupyter, "lab", f"--ServerApp.root_dir={folder}", f"--LabApp.default_url=/lab/tree/{DEMO_NOTEBOOK}"]
        if self.port:
            command.append(f"--ServerApp.port={self.port}")
        if self.ip:
            command.append(f"--ServerApp.ip={self.ip}")
        if not self.open_browser:
            command.append("--no-browser")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.append("--allow-root")  # containers and CI run as root; the demo touches no real GPU
        return command, env, folder

    def run(self) -> None:
        command, env, folder = self.prepare()
        print(f"jupyter-gpupool demo: simulated pool {env['GPUPOOL_SIMULATE']}, default slice {env['GPUPOOL_DEFAULT_MEMORY']}, "
              f"idle timeout {self.idle_timeout}; notebook in {folder}\n"
              f"  the CLI on this pool, from another terminal: {cli_hint(env)}", file=sys.stderr)
        if self.dry_run:
            print(" ".join(command))
            return
        os.execvpe(command[0], command, env)
