"""What a kernel pays at start when the pool stands aside (no GPU on the host).

Every kernel of an environment with the wheel's ``ipython_kernel_config.py`` runs
``jupyter_gpupool.kernel.autolease.configure()``; on a host without an NVIDIA driver it decides to
stand aside and imports none of the pool. This times that import and decision in fresh
interpreters that have already imported ``ipykernel.kernelapp`` (as a kernel has), alternating
with the same interpreters timing ``ipykernel.kernelapp``'s own import, so machine noise hits both
alike; medians over ``--runs``, and the ratio.

    python bench/stand_aside.py --runs 20 [--json bench/out/stand_aside.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jupyter_gpupool.kernel.autolease import NVIDIA_MARKERS

#: One fresh interpreter: ipykernel's import time, then the stand-aside's (milliseconds).
PROBE = (
    "import time\n"
    "t = time.perf_counter(); import ipykernel.kernelapp; kernelapp = time.perf_counter() - t\n"
    "t = time.perf_counter()\n"
    "from jupyter_gpupool.kernel.autolease import configure\n"
    "assert configure() is None, 'the pool did not stand aside'\n"
    "print(kernelapp * 1000, (time.perf_counter() - t) * 1000)\n"
)


def environment() -> dict[str, str]:
    """This environment less everything that would make the kernel lease (a simulated pool, a URL)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("GPUPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env


def measure(runs: int) -> dict[str, float]:
    env = environment()
    kernelapp, stand_aside = [], []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, timeout=120)
        first, second = (float(word) for word in out.stdout.split())
        kernelapp.append(first)
        stand_aside.append(second)
    ipykernel_ms, stand_aside_ms = statistics.median(kernelapp), statistics.median(stand_aside)
    return {"runs": runs, "ipykernel_import_ms": round(ipykernel_ms, 2), "stand_aside_ms": round(stand_aside_ms, 2),
            "stand_aside_over_ipykernel": round(stand_aside_ms / ipykernel_ms, 3)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="fresh interpreters to time (default 20)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if any(os.path.exists(marker) for marker in NVIDIA_MARKERS):
        print("this host has an NVIDIA driver: the pool does not stand aside here", file=sys.stderr)
        return 2
    result = measure(args.runs)
    print(
        f"standing aside: {result['stand_aside_ms']} ms median over {result['runs']} fresh interpreters; "
        f"importing ipykernel.kernelapp: {result['ipykernel_import_ms']} ms; ratio {result['stand_aside_over_ipykernel']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
