"""Make the checks runnable on a bare GPU machine, with the standard library only.

1. Install, from a folder of wheels (``tests/gpu/.wheels``, made by ``prepare.sh`` where pip
   works), every distribution this Python lacks, into ``--site`` (no index, no dependencies
   resolved: the folder holds the whole closure). Distributions already installed are left
   alone, so the machine's own torch/numpy/... are never shadowed.
2. Register jupyter_gpupool's entry points (the kernel provisioner) for the working tree on
   ``PYTHONPATH`` when no installed jupyter_gpupool provides them: a ``.dist-info`` folder in
   ``--site`` generated from ``pyproject.toml``, which is what an editable install would add.

Prints one line per step; never fails the run (a check whose needs are missing skips).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PROVISIONER_GROUP = "jupyter_client.kernel_provisioners"


def dist_name(wheel: Path) -> str:
    """``jupyter_server-2.21.1-py3-none-any.whl`` → ``jupyter-server`` (normalized)."""
    return re.sub(r"[-_.]+", "-", wheel.name.split("-", 1)[0]).lower()


def compatible(wheel: Path) -> bool:
    """Can this interpreter install ``wheel``? (py3/abi3/cpXY tags; any or x86-64/aarch64 Linux)."""
    parts = wheel.name[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    pythons, abis, platforms = parts[-3].split("."), parts[-2].split("."), parts[-1].split(".")
    here = sys.version_info[0] * 10 + sys.version_info[1]
    machine = platform.machine().lower()
    if not any(p == "any" or (p.startswith(("manylinux", "linux")) and p.endswith(machine)) for p in platforms):
        return False
    for py in pythons:
        if py in {"py3", f"py{sys.version_info[0]}{sys.version_info[1]}"}:
            return True
        if py.startswith("cp") and py[2:].isdigit():
            version = int(py[2:]) if len(py[2:]) <= 2 else int(py[2]) * 10 + int(py[3:])
            if "abi3" in abis and version <= here:
                return True
            if version == here and (f"cp{py[2:]}" in abis or "none" in abis):
                return True
    return False


def unpack(wheel: Path, site: Path) -> None:
    """Install ``wheel`` the plain way: unzip it, moving ``*.data/purelib|platlib`` to the top.

    Enough for imports and entry points (the ``.dist-info`` comes along); scripts and data
    files are skipped. Used only where pip is missing or fails.
    """
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = member.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in {"purelib", "platlib"}:
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if member.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as src, open(target, "wb") as dst:
                dst.write(src.read())


def installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def install_missing(wheels: Path, site: Path) -> str:
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"no wheels in {wheels} (fine if the machine has jupyter_server and ipykernel; else run tests/gpu/prepare.sh)"
    usable = [w for w in files if compatible(w)]
    missing = [w for w in usable if not installed(dist_name(w))]
    skipped = len(files) - len(usable)
    note = f" ({skipped} wheels are for another Python or machine)" if skipped else ""
    if not missing:
        return f"all {len(usable)} usable wheels' distributions already installed{note}"
    if importlib.util.find_spec("pip") is None:
        for wheel in missing:
            unpack(wheel, site)
        return f"no pip here: unpacked {len(missing)} of {len(files)} wheels into {site}{note}"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--disable-pip-version-check",
        "--target",
        str(site),
        "--upgrade",
        *map(str, missing),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        for wheel in missing:
            unpack(wheel, site)
        return f"pip install of {len(missing)} wheels failed ({' / '.join(tail)}); unpacked them into {site} instead"
    names = ", ".join(dist_name(w) for w in missing)
    return f"installed {len(missing)} of {len(files)} wheels into {site}: {names}{note}"


def _toml(path: Path) -> dict:
    import tomllib

    with open(path, "rb") as fh:
        return tomllib.load(fh)


def register_entry_points(repo: Path, site: Path, force: bool = False) -> str:
    """Write ``jupyter_gpupool-<version>.dist-info`` (entry points from pyproject.toml) into ``site``
    unless an installed distribution registers the provisioner already (or ``force``)."""
    eps = importlib.metadata.entry_points(group=PROVISIONER_GROUP)
    if not force and any(ep.name == "gpupool-provisioner" for ep in eps):
        return "gpupool-provisioner entry point already registered"
    try:
        project = _toml(repo / "pyproject.toml")["project"]
    except (OSError, KeyError, ImportError) as exc:
        return f"could not read pyproject.toml: {exc}"
    version_text = (
        (repo / "jupyter_gpupool" / "_version.py").read_text()
        if (repo / "jupyter_gpupool" / "_version.py").exists()
        else ""
    )
    match = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", version_text)
    version = match.group(1) if match else "0.0.0"
    folder = site / f"jupyter_gpupool-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: jupyter-gpupool\nVersion: {version}\n")
    lines: list[str] = []
    for group, entries in sorted(project.get("entry-points", {}).items()):
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
        lines.append("")
    if project.get("scripts"):
        lines.append("[console_scripts]")
        lines.extend(f"{name} = {target}" for name, target in project["scripts"].items())
        lines.append("")
    (folder / "entry_points.txt").write_text("\n".join(lines))
    (folder / "top_level.txt").write_text("jupyter_gpupool\n")
    return f"registered jupyter_gpupool {version} entry points for {repo} in {folder}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder of wheels to install from")
    parser.add_argument("--site", type=Path, required=True, help="folder to install into (put it on PYTHONPATH)")
    parser.add_argument("--repo", type=Path, required=True, help="the repository root (on PYTHONPATH)")
    args = parser.parse_args(argv)
    args.site.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(args.site))  # count what an earlier run installed there
    print(f"bootstrap: {install_missing(args.wheels, args.site)}", flush=True)
    importlib.invalidate_caches()
    print(f"bootstrap: {register_entry_points(args.repo, args.site)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
