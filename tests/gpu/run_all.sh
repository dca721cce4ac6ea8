#!/usr/bin/env bash
# jupyter-gpupool's GPU-only checks, end to end, in one call (see tests/gpu/README.md).
#
#   bash tests/gpu/run_all.sh [--only CHECKS] [--skip CHECKS] [--out DIR] [--slice 4GiB] [--require-gpu] ...
#
# Installs what this Python lacks from tests/gpu/.wheels (made by tests/gpu/prepare.sh), puts the
# working tree on PYTHONPATH, runs every check in its own process under one time budget, prints
# the table and, when $OUT (or --out) is set, writes results.json, results.md, checks.log there
# (and run.log, a copy of this output, into $OUT).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PY="${GPUCHECK_PYTHON:-$(command -v python3 || command -v python)}"
SITE="${GPUCHECK_SITE:-${TMPDIR:-/tmp}/gpucheck-site}"
export PYTHONUNBUFFERED=1

case " $* " in
  *" -h "*|*" --help "*|*" --list "*) ;;
  *) (cd "$HERE" && "$PY" -m gpucheck.bootstrap --wheels "${GPUCHECK_WHEELS:-$HERE/.wheels}" --site "$SITE" --repo "$ROOT") ;;
esac
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

cd "$HERE" || exit 2
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  "$PY" -m gpucheck "$@" 2>&1 | tee "$OUT/run.log"
  exit "${PIPESTATUS[0]}"
fi
exec "$PY" -m gpucheck "$@"
