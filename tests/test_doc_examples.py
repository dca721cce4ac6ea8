"""Every example in README.md, docs/*.md and bench/README.md is a promise: this file runs it.

Each fenced code block either runs here or has ``<!-- illustration: REASON -->`` (invisible on
GitHub) right before its fence. A block of a kind this file cannot run, without that marker,
fails ``test_every_block_runs_or_is_marked``: a new doc example without a test fails CI.

How each kind runs:

- ``bash``/``sh``: each command runs as a subprocess in a sandbox (a temporary ``HOME``, Jupyter
  config/data/runtime dirs, ``GPUPOOL_DB``, ``GPUPOOL_SIMULATE=2xA100-80GB`` unless the command
  sets its own, and a throwaway virtual environment first on ``PATH`` so ``--sys-prefix`` lands
  there) and must exit 0, or the code a trailing ``# exits N`` comment gives. ``export X=1`` (or
  ``X=1`` alone) sets a variable for the rest of the block; ``$X`` is expanded. Synopsis notation
  runs every form: ``[--json]`` with and without, ``user|group|kernel`` each alternative.
  ``LEASE_ID`` becomes the id of a lease made for that command. Long-running programs
  (``jupyter gpupool demo``/``broker``, ``jupyter lab``/``server``) must be alive and listening
  within a minute, then exit cleanly on SIGTERM; one whose line ends in ``&`` keeps running for
  the block's later lines (``GPUPOOL_URL=unix://... jupyter gpupool status`` reaches it). Checked without running: ``pip install``
  (the path, the package name and its extras must exist in pyproject.toml), ``apt-get install``
  (every package one that CI's ``.ci/run`` installs), ``python -m pytest``
  (this suite itself), ``npm test``/``npm run X`` (the script exists), ``bash FILE`` (the file
  exists and parses: ``tests/gpu`` needs a GPU), and ``jupyter gpupool simulate`` (arguments
  parsed and validated: a full run takes 25 s; tests/test_simulate.py runs it).
- ``python`` of ``c.X.y = ...``: executed into a traitlets ``Config``; our classes it configures
  must know every option and accept every value (``PoolPolicy.validate_all()``, the broker app
  built from it); JupyterHub config (``c.JupyterHub``, ``c.Spawner``) must declare well-formed,
  existing scopes, services and a ``GPUPOOL_URL`` that matches the service. JupyterHub blocks of
  one page run cumulatively, as one ``jupyterhub_config.py``. Other python: run in a subprocess
  against a simulated pool.
- ``yaml``, ``json``, ``ini``, ``toml``, ``csv``: parsed (illustrations too; a CSV sample must be
  rectangular); Z2JH values' ``GPUPOOL_*`` variables must apply to the policy.
- ``%gpupool`` magics (a block of only magic lines): run, in order, in a real kernel started with
  the provisioner on a simulated pool.
- ``text`` right below a shell block: that command's sample output. Another test must run the
  command (and compare its output, as tests/test_metering.py does); else mark it.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import csv
import functools
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from envs import environment_over_this_one
from traitlets.config import Config, LazyConfigValue

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
SANDBOX_SIMULATE = "2xA100-80GB"
LONG_RUNNING = [("jupyter", "gpupool", "demo"), ("jupyter", "gpupool", "broker"), ("jupyter", "lab"), ("jupyter", "server"),
                ("jupyter", "notebook"), ("jupyter-gpupool", "broker"), ("jupyter-gpupool", "demo")]
PLACEHOLDERS = {"LEASE_ID"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*illustration:\s*(?P<reason>.*?)\s*-->\s*$")
_EXIT = re.compile(r"#.*\bexits?\s+(?:with\s+)?(?:code\s+)?(?P<code>\d+)\b")


@dataclass
class Block:
    """One fenced code block of a doc page."""

    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    illustration: str | None  # the marker's reason
    after: Block | None = field(default=None, repr=False, compare=False)  # the block just above, if only blank lines between
    end_line: int = 0  # of the closing fence

    @property
    def id(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"

    @property
    def kind(self) -> str | None:
        """How this file runs it, or None when it cannot."""
        if self.lang in {"bash", "sh", "shell"}:
            return "shell"
        if self.lang in {"python", "py"}:
            return "python"
        if self.lang in {"yaml", "yml", "json", "ini", "toml", "csv"}:
            return "data"
        lines = [line.strip() for line in self.text.splitlines() if line.strip()]
        if self.lang in {"", "ipython"} and lines and all(line.startswith("%gpupool") for line in lines):
            return "magics"
        if self.lang in {"text", "console", "output"} and self.after is not None and self.after.kind == "shell":
            return "output"
        return None


def collect_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the illustration marker before it, if any."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        fence, indent = opening.group("fence"), len(opening.group("indent"))
        end = index + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        body = "\n".join(line[indent:] if line[:indent].isspace() or not indent else line.lstrip()
                         for line in lines[index + 1:end])
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _MARKER.match(lines[before]) if before >= 0 else None
        after = blocks[-1] if blocks and blocks[-1].end_line == before + 1 else None
        blocks.append(Block(path, index + 1, opening.group("info").strip().split(" ")[0].lower(), body + "\n",
                            marker.group("reason") if marker else None, after))
        blocks[-1].end_line = end + 1
        index = end + 1
    return blocks


BLOCKS = [block for doc in DOCS if doc.exists() for block in collect_blocks(doc)]


def test_every_block_runs_or_is_marked() -> None:
    assert len(BLOCKS) >= 10 and any(b.path.name == "multi-user.md" for b in BLOCKS)
    unrunnable = [b.id for b in BLOCKS if b.kind is None and b.illustration is None]
    assert not unrunnable, (
        f"code blocks this test cannot run: {unrunnable}; make them runnable or put "
        "<!-- illustration: WHY IT CANNOT RUN HERE --> right before the fence"
    )
    vague = [b.id for b in BLOCKS if b.illustration is not None and len(b.illustration.split()) < 3]
    assert not vague, f"say why these cannot run (a few words at least): {vague}"


def test_the_collector_sees_markers_and_indented_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("- item:\n\n  ```\n  %gpupool status\n  ```\n\n<!-- illustration: needs a JupyterHub here -->\n\n"
                    "```bash\nsudo tljh-config reload\n```\n\n```text\nsample output\n```\n\nprose\n\n```text\nx\n```\n")
    first, second, third, fourth = collect_blocks(page)
    assert (first.kind, first.text, first.illustration) == ("magics", "%gpupool status\n", None)
    assert (second.kind, second.illustration) == ("shell", "needs a JupyterHub here")
    assert third.kind == "output" and third.after is second  # sample output of the shell block above it
    assert fourth.kind is None and fourth.illustration is None  # a kind it cannot run, unmarked: fails the test above


# --- data blocks ----------------------------------------------------------------------------------


def check_data(block: Block) -> None:
    """Parse; Z2JH values: their GPUPOOL_* variables apply to the policy."""
    if block.lang == "json":
        json.loads(block.text)
        return
    if block.lang == "toml":
        tomllib.loads(block.text)
        return
    if block.lang == "csv":  # a sample: one header, every row as wide
        rows = list(csv.reader(io.StringIO(block.text.strip())))
        assert len(rows) >= 2 and all(len(row) == len(rows[0]) for row in rows), f"{block.id}: ragged CSV"
        return
    if block.lang == "ini":
        parser = configparser.ConfigParser(interpolation=None, strict=False)
        parser.optionxform = str  # type: ignore[assignment,method-assign]
        parser.read_string(block.text)
        exec_start = parser.get("Service", "ExecStart", fallback="")
        if "jupyter-gpupool" in exec_start:
            argv = shlex.split(exec_start)
            assert argv[1] == "broker", exec_start
            parse_broker_args(argv[2:])
        return
    data = yaml.safe_load(block.text)
    env = (data or {}).get("singleuser", {}).get("extraEnv", {}) if isinstance(data, dict) else {}
    gpupool_env = {key: str(value) for key, value in env.items() if key.startswith("GPUPOOL_")}
    if gpupool_env:
        from jupyter_gpupool.core.policy import PoolPolicy

        policy = PoolPolicy()
        policy.apply_env(gpupool_env)
        policy.validate_all()
        policy.default_memory_bytes(16 << 30)


def parse_broker_args(args: list[str]) -> None:
    """The broker accepts these arguments (parsed and validated, not served)."""
    from jupyter_gpupool.broker.app import BrokerApp

    app = BrokerApp()
    app.initialize(args)
    assert not app.extra_args, f"the broker ignores {app.extra_args}"
    int(app.socket_mode, 8)


# --- python blocks --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def our_configurables() -> dict[str, type]:
    """Every configurable class of the package by name: the configuration reference's, and any other
    ``Configurable`` a module of ``jupyter_gpupool`` defines (apps, identities, backends)."""
    import importlib
    import pkgutil

    from traitlets.config import Configurable

    import jupyter_gpupool
    from jupyter_gpupool.configref import CONFIGURABLES, _load

    classes = {cls.__name__: cls for cls in (_load(path) for path, _ in CONFIGURABLES)}
    for module_info in pkgutil.walk_packages(jupyter_gpupool.__path__, "jupyter_gpupool."):
        if module_info.name.endswith("__main__") or ".labextension" in module_info.name:
            continue
        try:
            module = importlib.import_module(module_info.name)
        except ImportError:  # an optional dependency (e.g. of the TLJH plugin) is not installed
            continue
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, Configurable) and value.__module__ == module.__name__:
                classes.setdefault(value.__name__, value)
    return classes


HUB_SECTIONS = {"JupyterHub", "Spawner", "LocalProcessSpawner", "Authenticator", "ConfigurableHTTPProxy"}


def exec_config(source: str, c: Config | None = None) -> Config:
    c = Config() if c is None else c
    exec(compile(source, "<doc>", "exec"), {"c": c, "get_config": lambda: c, "__name__": "__config__"})  # noqa: S102
    return c


def resolved(value: Any, initial: Any) -> Any:
    """A config value, with ``.append``/``.extend`` on an unset one applied."""
    return value.get_value(initial) if isinstance(value, LazyConfigValue) else value


def check_our_config(c: Config, tmp_path: Path, build_broker: bool = True) -> list[str]:
    """Every option of our classes exists and its value is accepted; the broker app builds."""
    ours = our_configurables()
    checked = []
    for section in c:
        if section in HUB_SECTIONS:
            continue
        assert section in ours, f"c.{section} configures nothing of jupyter-gpupool or JupyterHub"
        known = set(ours[section].class_trait_names(config=True))
        unknown = set(c[section]) - known
        assert not unknown, f"c.{section} has no option {sorted(unknown)}"
        checked.append(section)
    if not checked:
        return checked
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.enforcement.plan import EnforcementSettings
    from jupyter_gpupool.enforcement.watchdog import Watchdog
    from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner
    from jupyter_gpupool.serverextension.app import GpuPoolExtension

    PoolPolicy(config=c).validate_all()
    EnforcementSettings(config=c)
    Watchdog(config=c)
    GpuPoolExtension(config=c)
    GpuPoolProvisioner(config=c, kernel_id="doc-example", kernel_spec=None)
    for section in checked:  # the others: every value set on an instance, so each trait validates it
        cls = ours[section]
        if cls in {PoolPolicy, EnforcementSettings, Watchdog, GpuPoolExtension, GpuPoolProvisioner}:
            continue
        probe = cls.__new__(cls)  # traitlets sets up the traits here; __init__ may need a pool or a hub
        for name, value in c[section].items():
            setattr(probe, name, resolved(value, getattr(probe, name)))
    if build_broker and {"Broker", "HubIdentity", "PeerCredIdentity", "BrokerApp", "PoolPolicy"} & set(checked):
        config_file = tmp_path / "doc_config.py"
        config_file.write_text("c = get_config()\n" + "".join(f"c.{s}.{k} = {v!r}\n" for s in checked for k, v in c[s].items()))
        build_broker_from(config_file, tmp_path)
    return checked


def build_broker_from(config_file: Path, tmp_path: Path) -> None:
    """The broker app, given this config file on a simulated pool, builds its pool, broker and watchdog."""
    script = textwrap.dedent(f"""
        from jupyter_gpupool.broker.app import BrokerApp
        app = BrokerApp()
        app.initialize(["--config={config_file}", "--hub=off", "--socket={tmp_path / 'b.sock'}"])
        broker = app.build_broker()
        broker.pool.policy.validate_all()
        broker.pool.close()
    """)
    env = {**sandbox_base_env(tmp_path), "GPUPOOL_SIMULATE": SANDBOX_SIMULATE}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def check_hub_config(c: Config) -> None:
    """Scopes exist and are well-formed, roles name declared services, GPUPOOL_URL matches the service."""
    from jupyterhub import scopes

    hub = c.JupyterHub
    custom = resolved(hub.get("custom_scopes", {}), {})
    services = resolved(hub.get("services", []), [])
    roles = resolved(hub.get("load_roles", []), [])
    names = {service["name"] for service in services}
    new = {name: definition for name, definition in custom.items() if name not in scopes.scope_definitions}
    if new:
        scopes.define_custom_scopes(new)
    used: list[str] = list(resolved(c.Spawner.get("server_token_scopes", []), []))
    for role in roles:
        used += role.get("scopes", [])
        missing = set(role.get("services", [])) - names
        assert not missing, f"role {role['name']!r} names undeclared services {sorted(missing)}"
    for scope in used:
        scopes._check_scopes_exist([scope])  # JupyterHub's own check: the scope and its filter exist
        filter_ = scope.partition("!")[2]
        if filter_.startswith("service="):
            assert filter_[len("service="):] in names, f"{scope}: no service {filter_[len('service='):]!r} declared"
    for service in services:
        command = service.get("command")
        if command and command[1:3] == ["-m", "jupyter_gpupool.broker"]:
            import importlib.util

            assert importlib.util.find_spec("jupyter_gpupool.broker.__main__"), "python -m jupyter_gpupool.broker runs nothing"
            parse_broker_args(list(command[3:]))
    url = resolved(c.Spawner.get("environment", {}), {}).get("GPUPOOL_URL")
    if url:
        from jupyter_gpupool.backends.remote import RemotePool

        RemotePool(url)  # a URL the clients accept
        service = next(s for s in services if s.get("url") and url.startswith(s["url"]))
        assert url.rstrip("/").endswith(f"/services/{service['name']}"), url


def check_tljh_settings(block: Block) -> None:
    """What an illustrated shell block still lets us check: its ``pip install`` lines name this package
    and its extras; ``tljh-config set gpupool.KEY VALUE`` lines (and the keys their comments offer)
    are accepted by the TLJH plugin, its broker accepts the values, the hub config it writes is well-formed."""
    from jupyter_gpupool.apps.tljh import configure_hub
    from jupyter_gpupool.core.policy import PoolPolicy

    settings: dict[str, str] = {}
    for line in logical_lines(block.text):
        argv = shlex.split(line, comments=True)
        argv = argv[1:] if argv[:1] == ["sudo"] else argv
        if "pip" in argv[:3] and "install" in argv:  # illustrated installs still name this package
            check_pip_install(argv, REPO)
        if argv[:2] == ["tljh-config", "set"] and argv[2].startswith("gpupool."):
            settings[argv[2].split(".", 1)[1]] = argv[3]
            offered = re.search(r"#.*?:\s*(.*)$", line)
            for key in (offered.group(1).split(",") if offered else []):
                settings.setdefault(key.strip(), "")
    if not settings:
        return
    c = Config()
    configure_hub(c, settings)
    check_hub_config(c)
    broker_env = next(s.get("environment", {}) for s in c.JupyterHub.services if s["name"] == "gpupool")
    policy = PoolPolicy()
    policy.apply_env({key: value for key, value in broker_env.items() if key.startswith("GPUPOOL_")})
    policy.validate_all()
    policy.default_memory_bytes(16 << 30)


# --- the shell sandbox ----------------------------------------------------------------------------


#: Where a doc example may write, each in its sandbox: every file or folder the package and Jupyter
#: pick from the environment. Without GPUPOOL_BROKER_FILE a broker run as root records itself in
#: /etc/jupyter for every user of the machine; without the XDG ones caches land in the real home.
SANDBOX_PATHS = {
    "HOME": "home", "JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
    "IPYTHONDIR": "ipython", "XDG_CONFIG_HOME": "home/.config", "XDG_DATA_HOME": "home/.local/share",
    "XDG_CACHE_HOME": "home/.cache", "GPUPOOL_CACHE_DIR": "home/.cache/jupyter-gpupool",
    "GPUPOOL_BROKER_FILE": "discovery/gpupool-broker.json", "GPUPOOL_DB": "pool.sqlite",
}


def sandbox_base_env(tmp_path: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("GPUPOOL_", "JUPYTERHUB_", "JUPYTER_", "XDG_")) and key != "IPYTHONDIR"}
    for variable, relative in SANDBOX_PATHS.items():
        path = tmp_path / relative
        (path.parent if path.suffix else path).mkdir(parents=True, exist_ok=True)
        env[variable] = str(path)
    env.update(GPUPOOL_SIMULATE=SANDBOX_SIMULATE, BROWSER="true")
    return env


def test_the_sandbox_keeps_every_file_in_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A doc example run as root must not record a broker in /etc/jupyter, nor cache in the real home."""
    from jupyter_gpupool.apps.workload import cache_folder
    from jupyter_gpupool.backends.discovery import candidate_paths, write_paths

    monkeypatch.setenv("XDG_CACHE_HOME", "/root/.cache")
    env = sandbox_base_env(tmp_path)
    for variable in SANDBOX_PATHS:
        assert Path(env[variable]).is_relative_to(tmp_path), (variable, env[variable])
    assert all(Path(p).is_relative_to(tmp_path) for p in write_paths(env)), write_paths(env)
    assert all(Path(p).is_relative_to(tmp_path) for p in candidate_paths(env)), candidate_paths(env)
    with monkeypatch.context() as patched:
        for key, value in env.items():
            patched.setenv(key, value)
        assert cache_folder().is_relative_to(tmp_path), cache_folder()


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway environment seeing every installed package, with ``python`` and the ``jupyter*``
    commands, so ``--sys-prefix`` installs land in it, not in the shared interpreter (made the same
    from a virtual environment or from a plain interpreter such as CI's pyenv one: see envs.py)."""
    return environment_over_this_one(tmp_path_factory.mktemp("venv") / "env").bin


class Sandbox:
    """One doc block's environment: temporary dirs, a simulated pool, the throwaway venv first."""

    def __init__(self, tmp_path: Path, venv_bin: Path) -> None:
        self.dir = tmp_path
        self.work = tmp_path / "work"
        self.work.mkdir()
        self.env = sandbox_base_env(tmp_path)
        prefix = Path(sys.prefix)
        self.env.update(
            PATH=f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            # the venv's prefix hides the interpreter's: keep its server extensions and lab assets
            JUPYTER_PATH=str(prefix / "share" / "jupyter"), JUPYTER_CONFIG_PATH=str(prefix / "etc" / "jupyter"),
        )
        (tmp_path / "config" / "jupyter_server_config.json").write_text(
            json.dumps({"ServerApp": {"open_browser": False, "allow_root": True}}))
        self.venv_prefix = venv_bin.parent
        self.ran: list[str] = []

    def run(self, argv: list[str], env: dict[str, str], expect: int, timeout: float = 120) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=self.work, timeout=timeout, check=False)
        assert result.returncode == expect, (
            f"`{shlex.join(argv)}` exited {result.returncode}, the doc promises {expect}:\n{result.stderr[-3000:]}")
        self.ran.append(shlex.join(argv))
        return result.stdout

    def new_lease(self, env: dict[str, str]) -> str:
        """A granted lease of the sandbox's user, for a ``LEASE_ID`` (made in-process: quicker)."""
        from jupyter_gpupool.apps.cli import current_user
        from jupyter_gpupool.backends.local.pool import Pool
        from jupyter_gpupool.core.models import LeaseRequest

        pool = Pool.from_env(environ=env)
        try:
            return pool.request(LeaseRequest(owner=current_user(), memory=8 << 30, label="doc example")).id
        finally:
            pool.close()


def logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined; blank and comment-only lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def expand_synopsis(tokens: list[str]) -> list[list[str]]:
    """``[--json]`` and ``user|group|kernel`` → every form: optionals with and without, each alternative."""
    optional = [t.startswith("[") and t.endswith("]") for t in tokens]
    alternatives = [t.split("|") if "|" in t and t != "|" and not o else [t] for t, o in zip(tokens, optional)]
    forms = max([2 if any(optional) else 1, *(len(a) for a in alternatives)])
    variants = []
    for i in range(forms):
        variant = []
        for token, is_optional, alts in zip(tokens, optional, alternatives):
            if is_optional:
                if i % 2 == 0:
                    variant += token[1:-1].split()
            else:
                variant.append(alts[i % len(alts)])
        variants.append(variant)
    return variants


def expand_vars(text: str, env: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` from the sandbox's environment (unknown ones stay as written)."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m.group(1) or m.group(2), m.group(0)), text)


def starts_with(argv: list[str], prefix: tuple[str, ...]) -> bool:
    return tuple(argv[: len(prefix)]) == prefix


#: pip options whose next word is their value, not a package.
PIP_VALUE_OPTIONS = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links", "-c", "--constraint", "-r", "--requirement"}


def pip_targets(argv: list[str]) -> list[str]:
    """What ``pip install`` in ``argv`` installs (options and their values left out)."""
    words, targets = argv[argv.index("install") + 1:], []
    while words:
        word = words.pop(0)
        if word in PIP_VALUE_OPTIONS:
            words = words[1:]
        elif not word.startswith("-"):
            targets.append(word)
    return targets


def ci_pip_packages() -> set[str]:
    """The packages other than this project that ``.ci/run`` installs with pip (names, normalised)."""
    found = set()
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        if re.search(r"\bpip install\b", line):
            for target in pip_targets(shlex.split(line.split("||")[0])):
                found.add(re.sub(r"[-_.]+", "-", re.split(r"[\[=<>!~ ]", target)[0]).lower())
    return found


def check_pip_install(argv: list[str], cwd: Path) -> None:
    """This project (an existing path or its own name, with extras pyproject.toml declares), or a
    package ``.ci/run`` installs too (so the line is known to work on a clean machine)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project.get("optional-dependencies", {}))
    name = re.sub(r"[-_.]+", "-", project["name"]).lower()
    targets = pip_targets(argv)
    assert targets, f"`{shlex.join(argv)}` installs nothing"
    for target in targets:
        match = re.fullmatch(r"(?P<what>[^\[]+)(?:\[(?P<extras>[^\]]*)\])?", target)
        assert match, target
        what, wanted = match.group("what"), {e.strip() for e in (match.group("extras") or "").split(",") if e.strip()}
        if what.startswith((".", "/")):
            assert (cwd / what / "pyproject.toml").exists(), f"`pip install {target}`: {what} is no project in the checkout"
        elif (normal := re.sub(r"[-_.]+", "-", what).lower()) != name:
            assert normal in ci_pip_packages() and not wanted, f"`pip install {target}` is not this project ({name}) nor installed by .ci/run"
            continue
        assert wanted <= extras, f"`pip install {target}`: no extras {sorted(wanted - extras)} in pyproject.toml ({sorted(extras)})"


def check_apt_install(argv: list[str]) -> None:
    """Only packages CI installs on its clean machine (so the line is known to work there)."""
    ci = re.search(r"apt-get install (?P<args>[^>\n]*)", (REPO / ".ci" / "run").read_text())
    assert ci, ".ci/run installs no system packages"
    installed = {a for a in shlex.split(ci.group("args")) if not a.startswith("-")}
    wanted = {a for a in argv[argv.index("install") + 1:] if not a.startswith("-")}
    assert wanted, f"`{shlex.join(argv)}` installs nothing"
    assert wanted <= installed, f"`{shlex.join(argv)}`: .ci/run does not install {sorted(wanted - installed)}"


def check_statically(argv: list[str], cwd: Path) -> bool:
    """Commands checked without running (see the module docstring); False for the rest."""
    if "pip" in argv[:3] and "install" in argv:
        check_pip_install(argv, cwd)
    elif argv[:1] == ["apt-get"] or argv[:2] == ["sudo", "apt-get"]:
        assert "install" in argv, f"`{shlex.join(argv)}`: only apt-get install is checked here"
        check_apt_install(argv)
    elif starts_with(argv, ("python", "-m", "pytest")) or argv[0] == "pytest":
        import importlib.util

        assert importlib.util.find_spec("pytest"), "pytest is not installed (the test extra)"
        paths, words = [], argv[argv.index("pytest") + 1 :]
        while words:  # the paths, less the values of -m (a marker expression), -k and -n
            word = words.pop(0)
            if word in {"-m", "-k", "-n"}:
                words = words[1:]
            elif not word.startswith("-"):
                paths.append(word)
        assert all((cwd / p.split("::")[0]).exists() for p in paths), paths
    elif argv[0] == "npm":
        package = json.loads((cwd / "package.json").read_text())
        script = argv[1] if argv[1] in {"test", "start"} else argv[2] if argv[1] == "run" else None
        assert script in package.get("scripts", {}), f"`{shlex.join(argv)}`: no such script in {cwd / 'package.json'}"
    elif argv[0] in {"bash", "sh"} and len(argv) >= 2 and not argv[1].startswith("-"):
        assert (cwd / argv[1]).is_file(), f"{argv[1]} does not exist"
        subprocess.run(["bash", "-n", str(cwd / argv[1])], check=True, timeout=30)
    elif starts_with(argv, ("jupyter", "gpupool", "simulate")):
        script = ("import sys\nfrom jupyter_gpupool.apps.simulate import SimulateApp\napp = SimulateApp()\n"
                  "app.initialize(sys.argv[1:])\nassert not app.extra_args, app.extra_args\napp.settings()\n")
        result = subprocess.run([sys.executable, "-c", script, *argv[3:]], capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == 0, result.stderr[-2000:]
    else:
        return False
    return True


def run_long_running(sandbox: Sandbox, argv: list[str], env: dict[str, str], ready_within: float = 90) -> None:
    """Started, alive and listening within ``ready_within`` s (its arguments were accepted), then
    SIGTERM: it must exit cleanly."""
    stop_long_running(sandbox, *start_long_running(sandbox, argv, env, ready_within))


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``argv``, else None."""
    if name in argv and argv.index(name) + 1 < len(argv):
        return argv[argv.index(name) + 1]
    return next((a.split("=", 1)[1] for a in argv if a.startswith(name + "=")), None)


def _answers(port: int | None, unix_socket: str | None) -> bool:
    """Whether something accepts connections on the TCP port or the Unix socket."""
    if unix_socket:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1)
            return probe.connect_ex(unix_socket) == 0
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port or 0)) == 0


def start_long_running(
    sandbox: Sandbox, argv: list[str], env: dict[str, str], ready_within: float = 90
) -> tuple[list[str], subprocess.Popen[bytes], Path]:
    """Start a long-running program and return once it listens (on its --port, its --socket, or the
    port its log names); it is killed if it does not."""
    log_path = sandbox.dir / f"server-{len(sandbox.ran)}-{time.monotonic_ns()}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, env=env, cwd=sandbox.work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        unix_socket = _option(argv, "--socket")
        port_text = _option(argv, "--port")
        port = int(port_text) if port_text else None
        deadline = time.monotonic() + ready_within
        listening = False
        while time.monotonic() < deadline and not listening:
            time.sleep(0.5)
            assert process.poll() is None, f"`{shlex.join(argv)}` exited {process.returncode}:\n{log_path.read_text()[-3000:]}"
            text = log_path.read_text(errors="replace")
            if port is None and unix_socket is None:
                found = re.search(r"https?://(?:localhost|127\.0\.0\.1)[^\s:/]*:(\d+)/", text)
                if not found:
                    continue
                port = int(found.group(1))
            listening = _answers(port, unix_socket)
        assert listening, f"`{shlex.join(argv)}` is not listening after {ready_within:.0f} s:\n{log_path.read_text()[-3000:]}"
        if "broker" not in argv:  # a Jupyter server: the wheel enables the pool's server extension
            deadline = time.monotonic() + 30
            while "jupyter_gpupool | extension was successfully loaded" not in log_path.read_text(errors="replace"):
                assert time.monotonic() < deadline, f"`{shlex.join(argv)}` did not load jupyter_gpupool:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.5)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):  # it exited (and was reaped) already
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
        raise
    return argv, process, log_path


def stop_long_running(sandbox: Sandbox, argv: list[str], process: subprocess.Popen[bytes], log_path: Path) -> None:
    """SIGTERM a program :func:`start_long_running` started: it must exit 0 within a minute."""
    try:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        assert code == 0, f"`{shlex.join(argv)}` exited {code} on SIGTERM:\n{log_path.read_text()[-3000:]}"
        sandbox.ran.append(shlex.join(argv))
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)


def run_shell_block(block: Block, sandbox: Sandbox) -> None:
    background: list[tuple[list[str], subprocess.Popen[bytes], Path]] = []
    try:
        _run_shell_lines(block, sandbox, background)
    finally:
        for started in reversed(background):
            stop_long_running(sandbox, *started)


def _run_shell_lines(block: Block, sandbox: Sandbox, background: list[tuple[list[str], subprocess.Popen[bytes], Path]]) -> None:
    """Each line of a shell block in turn; a long-running program ending in ``&`` keeps running
    (listening) for the lines after it, and is stopped when the block ends."""
    for line in logical_lines(block.text):
        exit_comment = _EXIT.search(line)
        expect = int(exit_comment.group("code")) if exit_comment else 0
        tokens = shlex.split(line, comments=True)
        in_background = tokens[-1:] == ["&"]
        tokens = tokens[:-1] if in_background else tokens
        assert not {"|", ";", "||", ">", ">>", "<"} & set(tokens), (
            f"{block.id}: `{line}` uses a pipe or redirection this test does not run; split it, or mark the block")
        cwd = REPO
        commands: list[list[str]] = [[]]
        for token in tokens:
            if token == "&&":
                commands.append([])
            else:
                commands[-1].append(token)
        for command in commands:
            env = dict(sandbox.env)
            block_wide = command[:1] == ["export"]
            command = command[1:] if block_wide else command
            while command and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", command[0]):
                key, _, value = command.pop(0).partition("=")
                env[key] = expand_vars(value, env)
                if block_wide or not command:  # `export X=1` or `X=1` alone: for the rest of the block
                    sandbox.env[key] = env[key]
            if not command:
                continue
            command = [expand_vars(token, env) for token in command]
            if command[0] == "cd":
                cwd = cwd / command[1]
                assert cwd.is_dir(), f"{block.id}: `cd {command[1]}`: no such folder in the checkout"
                continue
            for argv in expand_synopsis(command):
                if check_statically(argv, cwd):
                    continue
                argv = [sandbox.new_lease(env) if token in PLACEHOLDERS else token for token in argv]
                long_running = any(starts_with(argv, prefix) for prefix in LONG_RUNNING) and "--dry-run" not in argv
                assert long_running or not in_background, f"{block.id}: `{line}`: only a long-running program may end in &"
                if in_background:
                    background.append(start_long_running(sandbox, argv, env))
                elif long_running:
                    run_long_running(sandbox, argv, env)
                else:
                    sandbox.run(argv, env, expect)


def check_sample_output(block: Block) -> None:
    """A sample of the command above it: some other test must run that command (and compare), as
    tests/test_metering.py does for the report sample; the command itself runs as its own block."""
    assert block.after is not None
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py") if p.name != Path(__file__).name)
    for line in logical_lines(block.after.text):
        command = line.split(" #")[0].strip()
        assert command in tests, (
            f"{block.id}: sample output of `{command}`, which no test under tests/ runs; have a test produce and "
            "compare it, or mark the sample an illustration")


# --- magics ---------------------------------------------------------------------------------------


def run_magics_block(block: Block, sandbox: Sandbox) -> None:
    """Each magic line, in order, in one real IPython kernel holding a slice of a simulated pool."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    lines = [line.strip() for line in block.text.splitlines() if line.strip()]
    notebook = new_notebook(cells=[new_code_cell(line.split("#")[0].strip()) for line in lines])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = sandbox.work / "magics.ipynb"
    nbformat.write(notebook, path)
    env = {**sandbox.env, "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner", "GPUPOOL_DEFAULT_MEMORY": "8GiB"}
    result = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(path),
                             "--output", "executed.ipynb", "--ExecutePreprocessor.timeout=60"],
                            capture_output=True, text=True, env=env, cwd=sandbox.work, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    executed = nbformat.read(sandbox.work / "executed.ipynb", as_version=4)
    for cell in executed.cells:
        errors = [o for o in cell.outputs if o.get("output_type") == "error" or o.get("name") == "stderr"]
        assert not errors, f"{block.id}: `{cell.source}` failed: {errors}"
        text = "".join(o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)
        assert "gpupool:" in text, f"{block.id}: `{cell.source}` answered {text!r}"


# --- the test -------------------------------------------------------------------------------------

_HUB_STATE: dict[Path, Config] = {}


def _param(block: Block) -> Any:
    slow = block.illustration is None and block.kind in {"shell", "magics"}
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, tmp_path: Path, venv_bin: Path) -> None:
    if block.kind == "data":
        check_data(block)  # illustrations too: they must at least parse
    if block.illustration is not None:
        if block.kind == "shell":
            subprocess.run(["bash", "-n"], input=block.text, text=True, check=True, timeout=30)
            check_tljh_settings(block)
        return
    assert block.kind is not None, f"{block.id}: unrunnable block without an illustration marker"
    if block.kind == "shell":
        run_shell_block(block, Sandbox(tmp_path, venv_bin))
    elif block.kind == "magics":
        run_magics_block(block, Sandbox(tmp_path, venv_bin))
    elif block.kind == "output":
        check_sample_output(block)
    elif block.kind == "python":
        tree = ast.parse(block.text)
        if "c.JupyterHub" in block.text or "c.Spawner" in block.text:
            # The hub blocks of one page build one jupyterhub_config.py, in order.
            previous = [b for b in BLOCKS if b.path == block.path and b.kind == "python" and b.line < block.line
                        and b.illustration is None and ("c.JupyterHub" in b.text or "c.Spawner" in b.text)]
            c = Config()
            for earlier in [*previous, block]:
                exec_config(earlier.text, c)
            check_hub_config(c)
            check_our_config(c, tmp_path)
        elif any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                 and isinstance(n.value.value, ast.Name) and n.value.value.id == "c" for n in ast.walk(tree)):
            c = exec_config(block.text)
            assert check_our_config(c, tmp_path), f"{block.id}: configures nothing"
        else:
            sandbox = Sandbox(tmp_path, venv_bin)
            script = sandbox.work / "example.py"
            script.write_text(block.text)
            sandbox.run([sys.executable, str(script)], sandbox.env, 0)


# --- examples inside the configuration reference ----------------------------------------------


def reference_examples() -> list[Any]:
    """``{...}``/``[...]`` examples in the help of dict and list options, as the README's table shows them."""
    from traitlets import Dict, List

    params = []
    for section, cls in our_configurables().items():
        for name, trait in sorted(cls.class_own_traits(config=True).items()):
            if not isinstance(trait, (Dict, List)):
                continue
            for number, example in enumerate(balanced_literals(trait.help or "")):
                params.append(pytest.param(section, name, example, id=f"{section}.{name}-{number}"))
    return params


def balanced_literals(text: str) -> list[Any]:
    """Python literals written in a help string (``{'a': 1}``, ``[...]``), parsed."""
    found = []
    index = 0
    while index < len(text):
        if text[index] in "{[":
            depth, end = 0, index
            for end in range(index, len(text)):
                depth += text[end] in "{[" and 1 or 0
                depth -= text[end] in "}]" and 1 or 0
                if depth == 0:
                    break
            try:
                found.append(ast.literal_eval(text[index:end + 1]))
                index = end + 1
                continue
            except (ValueError, SyntaxError):
                pass
        index += 1
    return found


@pytest.mark.parametrize("section, name, example", reference_examples())
def test_configuration_reference_examples_are_accepted(section: str, name: str, example: Any, tmp_path: Path) -> None:
    """The README's configuration reference is generated from these help strings: each example
    it shows must be a value the option accepts."""
    c = Config()
    if isinstance(example, dict) and all(isinstance(v, (str, int, float)) for v in example.values()) and \
            name.endswith(("_quotas",)):
        c[section][name] = {"someone": example}  # an example of one entry of a per-name mapping
    elif isinstance(example, dict) and name == "reservations":
        c[section][name] = [example]
    else:
        c[section][name] = example
    check_our_config(c, tmp_path, build_broker=False)


# --- the runner can fail ----------------------------------------------------------------------------


def _block(lang: str, text: str) -> Block:
    return Block(REPO / "README.md", 0, lang, text, None)


@pytest.mark.parametrize("lang, text, message", [
    ("python", 'c.PoolPolicy.idle_policy = "sometimes"\n', "idle_policy"),
    ("python", 'c.PoolPolicy.idle_timout = 60\n', "no option ['idle_timout']"),
    ("python", 'c.PoolPolicy.user_quotas = {"prof": {"guaranteed": "16GiB", "maximum": "8GiB"}}\n', "above maximum"),
    ("python", 'c.GpuPoolz.tick = 1\n', "configures nothing"),
    ("python", ('c.JupyterHub.services = [{"name": "gpupool", "url": "http://127.0.0.1:10101"}]\n'
                'c.Spawner.server_token_scopes = ["access:services!service=gpupol"]\n'), "no service 'gpupol'"),
    ("python", 'c.Spawner.server_token_scopes = ["access:service"]\n', "does not exist"),
    ("bash", 'pip install -e ".[gpu]"\n', "no extras ['gpu']"),
    ("bash", 'pip install jupyter-gpu-pool\n', "not this project"),
    ("bash", 'pip install tensorflow --index-url https://example.invalid/simple\n', "nor installed by .ci/run"),
    ("bash", 'apt-get install -y chromium slurm\n', "does not install ['slurm']"),
    ("bash", 'jupyter gpupool simulate --gpus 4xA100-80GB --users 0\n', "--users"),
    ("bash", 'jupyter gpupool status --every\n', "exited 2"),
    ("python", 'c.Watchdog.action = "explode"\n', "explode"),
    ("python", 'c.Broker.tick_interval = "soon"\n', "soon"),
    ("python", 'c.HubIdentity.cache_seconds = "ten"\n', "ten"),
    ("python", 'c.GpuPoolExtension.reclaim_action = "hibernate"\n', "hibernate"),
    ("bash", 'jupyter gpupool broker --port 8765 --hub maybe\n', "exited 2"),
    ("bash", 'jupyter gpupool release LEASE_ID && jupyter gpupool release LEASE_ID  # exits 0\n', ""),
    ("bash", 'export GPUPOOL_SIMULATE=1x16GiB\njupyter gpupool request 20GiB  # exits 3\n', ""),
    ("bash", 'GPUPOOL_SIMULATE=1x16GiB jupyter gpupool request 20GiB\n', "exited 3"),
])
def test_a_wrong_example_fails(lang: str, text: str, message: str, tmp_path: Path, venv_bin: Path) -> None:
    if not message:  # the control: each LEASE_ID is a fresh lease of the user, so both releases work
        test_doc_block(_block(lang, text), tmp_path, venv_bin)
        return
    with pytest.raises(Exception) as caught:
        test_doc_block(_block(lang, text), tmp_path, venv_bin)
    assert message in str(caught.value)


def test_tljh_settings_in_an_illustration_are_checked(tmp_path: Path, venv_bin: Path) -> None:
    block = Block(REPO / "docs" / "multi-user.md", 0, "bash", "sudo tljh-config set gpupool.default_memroy 8GiB\n", "needs TLJH as root")
    with pytest.raises(ValueError, match="default_memroy"):
        test_doc_block(block, tmp_path, venv_bin)
    block.text = "sudo tljh-config set gpupool.idle_timeout soon\n"
    with pytest.raises(Exception, match="soon"):
        test_doc_block(block, tmp_path, venv_bin)
    block.text = "sudo /opt/tljh/user/bin/python3 -m pip install jupyter-gpupool[gpu]\n"
    with pytest.raises(AssertionError, match="no extras"):
        test_doc_block(block, tmp_path, venv_bin)


def test_a_sample_no_test_produces_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```bash\njupyter gpupool leases --released --json\n```\n\n```text\n[]\n```\n")
    _, sample = collect_blocks(page)
    with pytest.raises(AssertionError, match="no test under tests/ runs"):
        check_sample_output(sample)
