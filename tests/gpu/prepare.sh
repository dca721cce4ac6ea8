#!/usr/bin/env bash
# Fill tests/gpu/.wheels with wheels of this project's runtime dependencies for the GPU
# machine's Python (3.12, x86-64 manylinux by default), so run_all.sh can install what that
# machine lacks without a network. Run it where pip reaches PyPI; carry tests/gpu/.wheels.
#
#   bash tests/gpu/prepare.sh            # GPUCHECK_PY_VERSION=3.12 by default
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYVER="${GPUCHECK_PY_VERSION:-3.12}"
DEST="${GPUCHECK_WHEELS:-$HERE/.wheels}"
PY="${PYTHON:-python3}"

# The runtime dependencies as pyproject.toml lists them (one source of truth).
mapfile -t DEPS < <("$PY" - "$ROOT/pyproject.toml" <<'PYCODE'
import sys, tomllib
with open(sys.argv[1], "rb") as fh:
    print("\n".join(tomllib.load(fh)["project"]["dependencies"]))
PYCODE
)

rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 --platform manylinux_2_5_x86_64 \
  --platform manylinux1_x86_64 \
  -d "$DEST" "${DEPS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# torch-memory-saver (no deps: the GPU machine's PyTorch) for the fast-parking check; the [cuda] extra for the suspend check: cuda.core.checkpoint on driver bindings 12.x (those run on
# every driver from 570 up; 13.x bindings need a CUDA 13 driver). No numpy here: the GPU machine's
# PyTorch stack has it (cuda.core needs it; without it the suspend check falls back to ctypes).
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --no-deps \
  --python-version "$PYVER" --implementation cp --abi "cp${PYVER/./}" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "cuda-core>=1.2" "${GPUCHECK_CUDA_BINDINGS:-cuda-bindings>=12.8,<13}" "cuda-pathfinder>=1.4.2" \
  "torch-memory-saver>=0.0.10" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
count=$(ls "$DEST"/*.whl | wc -l)
size=$(du -sh "$DEST" | cut -f1)
echo "prepare.sh: $count wheels ($size) for Python $PYVER in $DEST"
echo "prepare.sh: copy tests/gpu/.wheels (git-ignored) to the GPU machine along with the tree"

# What a device call carries: the tree (tracked and untracked files git does not ignore) and the
# wheels, 64 MiB at most together.
LIMIT=$((64 * 1024 * 1024))
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
if tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1) && [ -n "$tree" ]; then
  total=$((tree + wheels))
  echo "prepare.sh: the tree ($((tree / 1024 / 1024)) MiB) and the wheels ($((wheels / 1024 / 1024)) MiB) travel together: $((total / 1024 / 1024)) MiB of the 64 MiB a device call carries"
  if [ "$total" -gt "$LIMIT" ]; then
    echo "prepare.sh: error: $((total / 1024 / 1024)) MiB is more than a device call carries; leave out wheels the GPU machine has (its image's package list)" >&2
    exit 1
  fi
fi
