"""Median kernel start time with and without the gpupool provisioner.

Starts real ipykernel kernels (start + first kernel_info reply), alternating
``local-provisioner`` and ``gpupool-provisioner`` so machine noise hits both alike, on a
simulated pool in a temporary file. The gpupool side includes the lease transaction, the
environment plan and the kernel extension (``--ext=jupyter_gpupool.kernel``) it loads.

    python bench/kernel_start.py --runs 10 [--json bench/out/kernel_start.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from importlib.metadata import EntryPoint
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def start_once(provisioner: str) -> float:
    from jupyter_client.manager import AsyncKernelManager
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    KernelProvisionerFactory.instance().default_provisioner_name = provisioner
    km = AsyncKernelManager(kernel_name="python3")
    started = time.perf_counter()
    await km.start_kernel()
    if provisioner == "gpupool-provisioner":  # make sure the slice was really leased
        assert km.provisioner is not None and getattr(km.provisioner, "lease_id", None), "no lease taken"
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        return time.perf_counter() - started
    finally:
        client.stop_channels()
        await km.shutdown_kernel(now=True)


async def main(runs: int) -> dict[str, object]:
    from jupyter_client.provisioning.factory import KernelProvisionerFactory

    KernelProvisionerFactory.provisioners.setdefault(
        "gpupool-provisioner",
        EntryPoint("gpupool-provisioner", "jupyter_gpupool.provisioner:GpuPoolProvisioner", KernelProvisionerFactory.GROUP_NAME),
    )
    times: dict[str, list[float]] = {"local-provisioner": [], "gpupool-provisioner": []}
    await start_once("local-provisioner")  # warm caches (imports, kernelspec lookup) before timing
    await start_once("gpupool-provisioner")
    for _ in range(runs):
        for name in times:
            times[name].append(await start_once(name))
    local = statistics.median(times["local-provisioner"])
    gpupool = statistics.median(times["gpupool-provisioner"])
    return {
        "runs": runs,
        "median_seconds": {"local-provisioner": round(local, 4), "gpupool-provisioner": round(gpupool, 4)},
        "ratio": round(gpupool / local, 3),
        "all_seconds": {k: [round(v, 4) for v in vs] for k, vs in times.items()},
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="kernel starts per provisioner (default 10)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(GPUPOOL_DB=str(Path(tmp) / "pool.sqlite"), GPUPOOL_SIMULATE="1x80GiB", GPUPOOL_DEFAULT_MEMORY="8GiB")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))
        result = asyncio.run(main(args.runs))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    med = result["median_seconds"]
    print(
        f"median kernel start: local {med['local-provisioner']:.3f} s, gpupool {med['gpupool-provisioner']:.3f} s, "
        f"ratio {result['ratio']:.2f}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    cli()
