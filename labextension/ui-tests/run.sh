#!/usr/bin/env bash
# Browser tests of the lab extension against a real JupyterLab on a simulated pool.
# For each suite it starts `jupyter lab` on a free port with token auth and a throw-away
# config (GPUPOOL_SIMULATE=1x16GiB, GPUPOOL_DEFAULT_MEMORY=8GiB), runs the Playwright test
# in headless Chromium (/usr/bin/chromium, never downloaded), and stops the server.
# The elastic suite (not run by default: tests/test_labextension.py runs it on its own) shows an
# elastic slice grow and give its burst back. The slurm suite (not run by default: it needs root
# and Debian's slurm-wlm and munge) puts the server on the Slurm backend and starts a real
# single-node Slurm cluster for it (slurm_cluster_steps.py, tests/slurm_cluster.py), which is
# stopped whatever happens.
#
#   bash labextension/ui-tests/run.sh                 # both suites
#   bash labextension/ui-tests/run.sh gpupool         # one suite: gpupool | idle | suspend | resume-ahead | elastic | unpooled | notebook7 | notebook7-where-possible | unavailable | contrast | slurm
#   GPUPOOL_UI_SCREENSHOTS=/tmp/shots bash ...        # screenshots (default ui-tests/screenshots)
#
# Needs: jupyter_gpupool importable (pip install -e .) and `npm ci` done in labextension/.
set -euo pipefail

HERE="$(cd "$(dirname "$0")" && pwd)"
EXT="$(dirname "$HERE")"
REPO="$(dirname "$EXT")"
PYTHON="${PYTHON:-python}"
CHROMIUM_PATH="${CHROMIUM_PATH:-/usr/bin/chromium}"
export CHROMIUM_PATH
export GPUPOOL_UI_SCREENSHOTS="${GPUPOOL_UI_SCREENSHOTS:-$HERE/screenshots}"

if [ ! -x "$CHROMIUM_PATH" ]; then
  echo "ui-tests: no Chromium at $CHROMIUM_PATH (apt-get install chromium)" >&2
  exit 1
fi
if [ ! -x "$EXT/node_modules/.bin/playwright" ]; then
  echo "ui-tests: run 'npm ci' in $EXT first" >&2
  exit 1
fi

WORK=""
SERVER_PID=""
SLURM_PID=""
SLURM_ROOT=""
SLURM_FAILED=0
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
# Stop the Slurm cluster (after the server, whose kernels are its jobs): SIGTERM to its owner,
# which cancels the jobs and stops the daemons by pid; SIGKILL if it hangs, and then a reap of
# whatever daemon or slurmstepd a killed owner left running.
stop_slurm() {
  if [ -n "$SLURM_PID" ]; then
    if kill -0 "$SLURM_PID" 2>/dev/null; then
      kill -TERM "$SLURM_PID" 2>/dev/null || true
      for _ in $(seq 1 200); do kill -0 "$SLURM_PID" 2>/dev/null || break; sleep 0.2; done
      kill -KILL "$SLURM_PID" 2>/dev/null || true
    fi
    wait "$SLURM_PID" 2>/dev/null || SLURM_FAILED=1
    "$PYTHON" "$HERE/slurm_cluster_steps.py" reap || true
  fi
  SLURM_PID=""
  if [ -n "$SLURM_ROOT" ]; then
    if [ "$SLURM_FAILED" = 1 ] || [ "${status:-0}" -ne 0 ]; then
      echo "---- Slurm daemons' logs ($SLURM_ROOT/log) ----" >&2
      for log in "$SLURM_ROOT"/log/*; do echo "--- $log" >&2; tail -n 20 "$log" >&2 || true; done
      cat "$SLURM_ROOT/steps.log" >&2 2>/dev/null || true
    else
      rm -rf "$SLURM_ROOT"
    fi
  fi
  SLURM_ROOT=""
}
cleanup() {
  status=$?
  stop_server
  stop_slurm
  if [ "$SLURM_FAILED" = 1 ] && [ "$status" -eq 0 ]; then
    echo "ui-tests: the Slurm cluster did not stop cleanly" >&2
    status=1
  fi
  if [ "$status" -ne 0 ] && [ -n "$WORK" ] && [ -f "$WORK/server.log" ]; then
    echo "---- last lines of the server log ($WORK/server.log) ----" >&2
    tail -n 60 "$WORK/server.log" >&2 || true
  elif [ -n "$WORK" ]; then
    rm -rf "$WORK"
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The labextension: this checkout's build (jupyter_gpupool/labextension, from `npm run build`)
# whenever it differs from the installed one, so the browser runs the code under test and not
# whatever another checkout installed; else the installed one; else build this checkout.
USE_CHECKOUT_BUILD=0
BUILD="$REPO/jupyter_gpupool/labextension"
installed_build="$("$PYTHON" - <<'PY' 2>/dev/null || true
import json, os
from jupyter_core.paths import jupyter_path
for folder in jupyter_path("labextensions"):
    package = os.path.join(folder, "jupyter-gpupool", "package.json")
    if os.path.isfile(package):
        with open(package, encoding="utf-8") as f:
            print(json.load(f)["jupyterlab"]["_build"]["load"])
        break
PY
)"
checkout_build=""
if [ -f "$BUILD/package.json" ]; then
  checkout_build="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["jupyterlab"]["_build"]["load"])' "$BUILD/package.json" 2>/dev/null || true)"
fi
if [ -z "$installed_build" ] && [ -z "$checkout_build" ]; then
  (cd "$EXT" && npm run build:prod >/dev/null)
  USE_CHECKOUT_BUILD=1
  echo "ui-tests: jupyter-gpupool is not installed as a lab extension; built $BUILD"
elif [ -n "$checkout_build" ] && [ "$checkout_build" != "$installed_build" ]; then
  USE_CHECKOUT_BUILD=1
  echo "ui-tests: using this checkout's build $BUILD ($checkout_build; installed: ${installed_build:-none})"
else
  echo "ui-tests: using the installed jupyter-gpupool lab extension (${installed_build})"
fi

# run_suite SPEC [NAME=VALUE | unset=NAME | --Server.option=value | app=notebook | pool=corrupt |
# slurm=cluster | kernelspec=NAME:SIZE ...]: a fresh server with these environment variables and
# options, then SPEC. pool=corrupt starts it on a pool file that is not a pool (the server then
# serves with the pool unavailable); slurm=cluster starts a Slurm cluster first and gives the
# server its SLURM_CONF; kernelspec=NAME:SIZE installs a kernelspec whose kernels ask for SIZE
# (`jupyter gpupool kernelspec install`, in the server's data folder) and a notebook NAME.ipynb
# that uses it.
run_suite() {
  local spec="$1"
  shift
  WORK="$(mktemp -d -t gpupool-ui.XXXXXX)"
  local port token
  port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  token="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(24))')"
  mkdir -p "$WORK"/{root,config,data,runtime,user-settings,app-settings,workspaces,labextensions}

  # Three notebooks that start a Python kernel when opened.
  for name in a b c; do
    cat >"$WORK/root/$name.ipynb" <<NB
{"cells": [{"cell_type": "code", "execution_count": null, "id": "c1", "metadata": {}, "outputs": [],
  "source": ["import os; os.environ.get('CUDA_VISIBLE_DEVICES')"]}],
 "metadata": {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
              "language_info": {"name": "python"}},
 "nbformat": 4, "nbformat_minor": 5}
NB
  done

  # The server extension on even before the wheel's config file is installed.
  cat >"$WORK/config/jupyter_server_config.json" <<'JSON'
{"ServerApp": {"jpserver_extensions": {"jupyter_gpupool": true}}}
JSON
  # No news prompt (--LabApp.news_url=None does not stop it) and no update check.
  cat >"$WORK/app-settings/overrides.json" <<'JSON'
{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}
JSON

  local args=(
    --no-browser
    --ServerApp.ip=127.0.0.1 --ServerApp.port="$port" --ServerApp.port_retries=0
    --IdentityProvider.token="$token"
    --ServerApp.root_dir="$WORK/root"
    --LabApp.app_settings_dir="$WORK/app-settings"
    --LabApp.news_url=None
    --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate
    --LabApp.expose_app_in_browser=True
  )
  if [ "$(id -u)" = 0 ]; then args+=(--ServerApp.allow_root=True); fi
  if [ "$USE_CHECKOUT_BUILD" = 1 ]; then
    ln -s "$REPO/jupyter_gpupool/labextension" "$WORK/labextensions/jupyter-gpupool"
    args+=(--LabApp.extra_labextensions_path="$WORK/labextensions")
  fi
  local envs=() unsets=() module=jupyterlab slurm_conf=""
  for item in "$@"; do
    case "$item" in
      unset=*) unsets+=("${item#unset=}") ;;
      slurm=cluster)
        start_slurm
        slurm_conf="$SLURM_CONF_OF_CLUSTER"
        envs+=("SLURM_CONF=$slurm_conf")
        ;;
      pool=corrupt)
        head -c 8192 /dev/urandom >"$WORK/pool.sqlite"
        ;;
      kernelspec=*)
        local spec_name="${item#kernelspec=}"
        local spec_size="${spec_name#*:}"
        spec_name="${spec_name%%:*}"
        JUPYTER_DATA_DIR="$WORK/data" GPUPOOL_SIMULATE="${GPUPOOL_SIMULATE:-1x16GiB}" GPUPOOL_DB="$WORK/pool.sqlite" PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" \
          "$PYTHON" -m jupyter_gpupool.apps.cli kernelspec install --user --name "$spec_name" \
          --display-name "Python 3 ($spec_size)" --memory "$spec_size" >/dev/null
        cat >"$WORK/root/$spec_name.ipynb" <<NB
{"cells": [{"cell_type": "code", "execution_count": null, "id": "c1", "metadata": {}, "outputs": [],
  "source": ["import os; os.environ.get('GPUPOOL_MEMORY_LIMIT')"]}],
 "metadata": {"kernelspec": {"display_name": "Python 3 ($spec_size)", "language": "python", "name": "$spec_name"},
              "language_info": {"name": "python"}},
 "nbformat": 4, "nbformat_minor": 5}
NB
        ;;
      app=notebook)
        module=notebook
        local kept=()
        for a in "${args[@]}"; do
          case "$a" in
            --LabApp.news_url=* | --LabApp.check_for_updates_class=*) ;; # JupyterLab only
            --LabApp.*) kept+=("--JupyterNotebookApp.${a#--LabApp.}") ;;
            *) kept+=("$a") ;;
          esac
        done
        args=("${kept[@]}")
        ;;
      --*) args+=("$item") ;;
      *) envs+=("$item") ;;
    esac
  done

  echo "ui-tests[$spec]: starting $module on 127.0.0.1:$port (log: $WORK/server.log)"
  (
    cd "$WORK/root"
    export GPUPOOL_SIMULATE="${GPUPOOL_SIMULATE:-1x16GiB}"
    export GPUPOOL_DEFAULT_MEMORY="${GPUPOOL_DEFAULT_MEMORY:-8GiB}"
    export GPUPOOL_DB="$WORK/pool.sqlite"
    export JUPYTER_CONFIG_DIR="$WORK/config"
    export JUPYTER_DATA_DIR="$WORK/data"
    export JUPYTER_RUNTIME_DIR="$WORK/runtime"
    export JUPYTERLAB_SETTINGS_DIR="$WORK/user-settings"
    export JUPYTERLAB_WORKSPACES_DIR="$WORK/workspaces"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
    for assignment in ${envs[@]+"${envs[@]}"}; do export "$assignment"; done
    for name in ${unsets[@]+"${unsets[@]}"}; do unset "$name"; done
    exec "$PYTHON" -m "$module" "${args[@]}"
  ) >"$WORK/server.log" 2>&1 &
  SERVER_PID=$!

  # Wait until GET /api/gpupool/pool answers with the token, at most 90 s.
  local url="http://127.0.0.1:$port/"
  "$PYTHON" - "$url" "$token" "$SERVER_PID" <<'PY'
import os, sys, time, urllib.request
url, token, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline, last = time.monotonic() + 90, None
while True:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("ui-tests: the server exited early")
    try:
        req = urllib.request.Request(url + "api/gpupool/pool", headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=5) as r:
            if r.status == 200:
                break
    except Exception as error:
        last = error
    if time.monotonic() > deadline:
        sys.exit(f"ui-tests: GET /api/gpupool/pool does not answer ({last}); is the jupyter_gpupool server extension importable?")
    time.sleep(0.2)
PY

  # The pool file and a Python that imports this checkout, for specs that act on the pool directly.
  (cd "$EXT" && GPUPOOL_UI_URL="$url" GPUPOOL_UI_TOKEN="$token" GPUPOOL_UI_DB="$WORK/pool.sqlite" \
    GPUPOOL_UI_PYTHON="$PYTHON" GPUPOOL_UI_REPO="$REPO" GPUPOOL_UI_SLURM_CONF="$slurm_conf" \
    npx playwright test -c ui-tests/playwright.config.ts --output "$WORK/test-results" "ui-tests/$spec.spec.ts")
  stop_server
  stop_slurm
  if [ "$SLURM_FAILED" = 1 ]; then
    echo "ui-tests[$spec]: the Slurm cluster did not stop cleanly" >&2
    exit 1
  fi
  rm -rf "$WORK"
  WORK=""
}

# Start a Slurm cluster in a fresh gpupool-slurm-* folder; SLURM_CONF_OF_CLUSTER says where its
# slurm.conf is once its node is idle.
start_slurm() {
  local reason
  if ! reason="$("$PYTHON" "$HERE/slurm_cluster_steps.py" check)"; then
    echo "ui-tests: no Slurm cluster can run here: $reason" >&2
    exit 1
  fi
  SLURM_ROOT="$(mktemp -d -t gpupool-slurm-XXXXXX)"
  "$PYTHON" "$HERE/slurm_cluster_steps.py" serve "$SLURM_ROOT" >"$SLURM_ROOT/steps.log" 2>&1 &
  SLURM_PID=$!
  for _ in $(seq 1 300); do
    [ -f "$SLURM_ROOT/cluster.env" ] && break
    if ! kill -0 "$SLURM_PID" 2>/dev/null; then
      echo "ui-tests: the Slurm cluster did not start:" >&2
      cat "$SLURM_ROOT/steps.log" >&2
      exit 1
    fi
    sleep 0.2
  done
  if [ ! -f "$SLURM_ROOT/cluster.env" ]; then
    echo "ui-tests: the Slurm cluster did not start within 60 s" >&2
    exit 1
  fi
  SLURM_CONF_OF_CLUSTER="$(sed -n 's/^SLURM_CONF=//p' "$SLURM_ROOT/cluster.env")"
  echo "ui-tests: Slurm cluster up (SLURM_CONF=$SLURM_CONF_OF_CLUSTER)"
}

SUITES=("$@")
if [ "${#SUITES[@]}" -eq 0 ]; then
  SUITES=(gpupool idle suspend resume-ahead unpooled unavailable contrast notebook7-where-possible)
fi
for suite in "${SUITES[@]}"; do
  case "$suite" in
    # Notebook 7 where it is installed and serves the installed extension; else one line why not.
    notebook7-where-possible)
      if "$PYTHON" -c "import notebook.app" 2>/dev/null && [ "$USE_CHECKOUT_BUILD" = 0 ]; then
        run_suite notebook7 app=notebook
      elif [ "$USE_CHECKOUT_BUILD" = 1 ]; then
        echo "ui-tests: the lab suites use this checkout's build, which Notebook 7 does not load: the notebook7 suite does not run"
      else
        echo "ui-tests: Notebook 7 is not installed (pip install notebook): the notebook7 suite does not run"
      fi
      ;;
    gpupool) run_suite gpupool ;;
    idle)
      # Culled, not suspended: this suite shows a reclaim that shuts the kernel down (the suspend
      # suite shows the other kind), whether or not the server can checkpoint.
      run_suite idle GPUPOOL_IDLE_POLICY=always GPUPOOL_IDLE_TIMEOUT=3 GPUPOOL_WARNING_PERIOD=10 \
        GPUPOOL_RECLAIM_ACTION=cull --GpuPoolExtension.reclaim_action=cull --GpuPoolExtension.tick_interval=1
      ;;
    notebook7)
      if [ "$USE_CHECKOUT_BUILD" = 1 ]; then
        # Notebook 7 does not serve extensions from extra_labextensions_path.
        echo "ui-tests: the notebook7 suite needs the extension installed (pip install -e .)" >&2
        exit 1
      fi
      run_suite notebook7 app=notebook
      ;;
    suspend) run_suite suspend GPUPOOL_RECLAIM_ACTION=suspend GPUPOOL_PARKED_MEMORY_LIMIT=32GiB ;;
    resume-ahead) run_suite resume-ahead GPUPOOL_RECLAIM_ACTION=suspend GPUPOOL_PARKED_MEMORY_LIMIT=32GiB ;;
    # Elastic slices: a 2 GiB default that may grow to the whole 16 GiB GPU, and a notebook whose
    # kernelspec asks for 12 GiB (the room another slice's burst holds).
    elastic) run_suite elastic GPUPOOL_DEFAULT_MEMORY=2GiB GPUPOOL_BURST=16GiB kernelspec=python3-12gib:12GiB ;;
    unavailable) run_suite unavailable pool=corrupt ;;
    # Readability in both themes, with an idle countdown on screen (the warning lasts 10 min).
    contrast)
      run_suite contrast GPUPOOL_IDLE_POLICY=always GPUPOOL_IDLE_TIMEOUT=3 GPUPOOL_WARNING_PERIOD=600 \
        GPUPOOL_RECLAIM_ACTION=cull --GpuPoolExtension.reclaim_action=cull --GpuPoolExtension.tick_interval=1
      ;;
    # A process without a lease holds GPU memory: the watchdog looks every half second.
    unpooled) run_suite unpooled --Watchdog.interval=0.5 ;;
    slurm)
      # Kernels as Slurm jobs on 8-shard slices (80 GiB of an 80 GiB GPU with 8 shards): two run
      # on the 16-shard node, a third pends. Short caches so the sidebar follows Slurm in seconds.
      run_suite slurm slurm=cluster GPUPOOL_BACKEND=slurm GPUPOOL_DEFAULT_MEMORY=80GiB GPUPOOL_IDLE_POLICY=never \
        unset=GPUPOOL_SIMULATE unset=GPUPOOL_DB unset=GPUPOOL_URL \
        --GpuPoolExtension.tick_interval=0.5 --GpuPoolExtension.reconcile_interval=1 \
        --SlurmPool.cache_seconds=0.3 --SlurmPool.poll_interval=0.5
      ;;
    *) echo "ui-tests: unknown suite '$suite' (gpupool, idle, suspend, resume-ahead, elastic, unpooled, notebook7, notebook7-where-possible, unavailable, contrast, slurm)" >&2; exit 2 ;;
  esac
done
echo "ui-tests: passed; screenshots in $GPUPOOL_UI_SCREENSHOTS"
