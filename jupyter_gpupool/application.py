"""The base of every command-line application: a traitlets app that opens the pool from config and
``GPUPOOL_*`` variables, and turns every mistake into one line and an exit code (never a traceback).

``jupyter gpupool`` and its subcommands (:mod:`jupyter_gpupool.apps.cli`), the simulator, the demo,
the kernelspec installer and the broker (:mod:`jupyter_gpupool.broker.app`) are built on it.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import sqlite3
import sys
from typing import Any, NoReturn

from jupyter_core.application import JupyterApp, base_aliases, base_flags
from traitlets import Bool, TraitError, Unicode, default
from traitlets.config.loader import KVArgParseConfigLoader, _KVArgParser

from jupyter_gpupool._version import __version__
from jupyter_gpupool.backends.discovery import find_broker
from jupyter_gpupool.backends.factory import pool_from_env
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, PoolUnavailable
from jupyter_gpupool.units import parse_duration, parse_size

EXIT_USAGE = 2


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        return "user"


class GpuPoolBaseApp(JupyterApp):
    """Shared by every subcommand: builds the pool from config and ``GPUPOOL_*`` variables."""

    version = __version__
    classes = [PoolPolicy]
    aliases = {**base_aliases, "db": "GpuPoolBaseApp.db", "simulate": "GpuPoolBaseApp.simulate"}
    flags = {
        **base_flags,
        "json": ({"GpuPoolBaseApp": {"json": True}}, "Print JSON instead of a table."),
    }

    db = Unicode("", help="Path of the pool's SQLite file (default: $GPUPOOL_DB or a per-user file).").tag(config=True)
    simulate = Unicode(
        "", help="Use a simulated inventory such as 1x16GiB or 2xA100-80GB (default: $GPUPOOL_SIMULATE, else NVML)."
    ).tag(config=True)
    json = Bool(False, help="Print JSON instead of a table.").tag(config=True)
    #: Whether a pool not chosen by GPUPOOL_URL / GPUPOOL_DB / GPUPOOL_SIMULATE is this host's broker
    #: (see :mod:`jupyter_gpupool.backends.discovery`); the broker itself turns it off.
    discover_broker = True

    @default("config_file_name")
    def _config_file_name_default(self) -> str:
        return "jupyter_gpupool_config"

    def make_pool(self) -> Any:
        env = dict(os.environ)
        if self.simulate:
            env["GPUPOOL_SIMULATE"] = self.simulate
        if self.db:
            env["GPUPOOL_DB"] = self.db
        if self.discover_broker:
            found = find_broker(env, on_ignored=lambda why: print(f"{command_words(self.name)}: warning: {why}", file=sys.stderr))
            if found is not None:
                return self._discovered_pool(found, env)
        # With GPUPOOL_URL set this is the broker (which decides who is admin); never a silent local pool.
        try:
            return pool_from_env(config=self.config, environ=env, discover=False)  # looked for above
        except PoolUnavailable as err:
            if not self.discover_broker or any((env.get(v) or "").strip() for v in ("GPUPOOL_URL", "GPUPOOL_SIMULATE")):
                raise
            # Nothing chose a pool and this host has no GPU driver: say both ways out, once.
            reason = str(err).split("; set GPUPOOL_SIMULATE")[0]
            raise PoolUnavailable(
                f"{reason}, and no broker is configured for this host: set GPUPOOL_URL to the broker's address "
                "(e.g. unix:///run/jupyter-gpupool/broker.sock) for the host's shared pool, or GPUPOOL_SIMULATE=1x16GiB "
                "for a simulated pool"
            ) from None

    def _discovered_pool(self, found: Any, env: dict[str, str]) -> Any:
        """The broker named by this host's discovery file, checked now so a dead one is named as such."""
        remote = RemotePool.from_env({**env, "GPUPOOL_URL": found.url})
        try:
            return remote.check()
        except PoolUnavailable as err:
            match = re.search(r"not reachable \(([^)]*)\)", str(err))
            raise PoolUnavailable(
                f"this host's GPU pool broker ({found.url}, recorded in {found.path}) is not answering "
                f"({match.group(1) if match else err}); "
                "start it (e.g. systemctl start jupyter-gpupool), set GPUPOOL_URL to where it runs now, "
                f"or delete {found.path} if the host no longer has one"
            ) from None

    def _create_loader(self, argv: Any, aliases: Any, flags: Any, classes: Any) -> Any:
        """Argument mistakes become one :class:`InvalidInput` line (exit 2), not a usage dump."""
        return _OneLineLoader(argv, aliases, flags, classes=classes, log=self.log, subcommands=self.subcommands, command=self.name)

    def parse_command_line(self, argv: Any = None) -> None:
        argv = list(sys.argv[1:] if argv is None else argv)
        if not (self.subcommands and argv and argv[0] in self.subcommands):  # the subcommand does its own
            argv = negative_values_as_values(argv, self.aliases)
        super().parse_command_line(argv)

    def update_config(self, config: Any) -> None:
        """A value of the wrong type (``--users abc``, ``--port abc``) is one line, exit 2, not
        traitlets' ``CRITICAL | Bad config`` and exit 1."""
        try:
            super().update_config(config)
        except TraitError as err:
            raise InvalidInput(self._trait_error_text(err)) from None

    def _trait_error_text(self, err: TraitError) -> str:
        options = {target: f"--{alias}" for alias, target in self.aliases.items() if isinstance(alias, str) and isinstance(target, str)}

        def option(match: re.Match[str]) -> str:
            trait, owner = match.group(1), match.group(2)
            by_trait = [o for target, o in options.items() if target.rsplit(".", 1)[-1] == trait]
            return options.get(f"{owner}.{trait}") or (by_trait[0] if len(by_trait) == 1 else f"--{owner}.{trait}")

        text = re.sub(r"The '(\w+)' trait of an? (\w+) instance", option, str(err).strip())
        return f"{text.rstrip('.')}; see `{command_words(self.name)} --help`"

    def refuse_extra_args(self) -> None:
        """For subcommands that take no positional words: a stray one is a mistake, not ignored
        (``--memory 8 GiB`` must not install an 8-byte slice and drop ``GiB``)."""
        if not self.extra_args:
            return
        stray = self.extra_args
        shown = ", ".join(repr(word) for word in stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        plural = "s" if len(stray) > 1 else ""
        raise InvalidInput(f"unexpected argument{plural} {shown}{self._one_word_hint()}; see `{command_words(self.name)} --help`")

    def _one_word_hint(self) -> str:
        """``(write it as one word: --memory 8GiB)`` when a stray word completes the option value
        before it into a valid size or duration, else ``""``."""
        argv = [str(a) for a in getattr(self, "argv", None) or []]
        for i, word in enumerate(argv):
            if word not in self.extra_args or i == 0:
                continue
            option, value = argv[i - 1], None
            if "=" in option and option.startswith("--"):
                option, value = option.split("=", 1)
            elif i >= 2 and argv[i - 2].startswith("--") and "=" not in argv[i - 2]:
                option, value = argv[i - 2], argv[i - 1]
            if value is None or not option.startswith("--") or option[2:] not in self.aliases:
                continue
            joined = f"{value}{word}"
            for check in (lambda t: parse_size(t, gpu_memory=1), parse_duration):
                try:
                    check(joined)
                except InvalidInput:
                    continue
                return f" (a value is one word: {option} {joined})"
        return ""

    def emit(self, data: Any, text: str) -> None:
        print(json.dumps(data, indent=2, default=str) if self.json else text)

    #: Whether the subcommand takes positional words (a lease id, a reservation name); the others
    #: refuse any with exit 2.
    takes_arguments = False

    def start(self) -> None:
        try:
            if not self.takes_arguments and not self.subcommands:
                self.refuse_extra_args()
            self.run()
        except GpuPoolError as err:
            print(f"{command_words(self.name)}: error: {err}", file=sys.stderr)
            self.exit(err.exit_code)
        except sqlite3.Error as err:  # the store turns these into PoolUnavailable; this is the last guard
            print(f"{command_words(self.name)}: error: the pool database failed: {err}", file=sys.stderr)
            self.exit(PoolUnavailable.exit_code)
        except TimeoutError as err:
            print(f"jupyter gpupool: {err}", file=sys.stderr)
            self.exit(1)

    def run(self) -> None:
        """What the subcommand does; a subcommand that does not say prints its help."""
        self.print_help()
        self.exit(EXIT_USAGE)

    @classmethod
    def launch_instance(cls, argv: Any = None, **kwargs: Any) -> None:  # type: ignore[override]
        try:
            super().launch_instance(argv=argv, **kwargs)
        except GpuPoolError as err:
            print(f"jupyter gpupool: error: {err}", file=sys.stderr)
            sys.exit(err.exit_code)
        except Exception as err:  # traitlets errors in config or arguments
            if type(err).__name__ in {"TraitError", "ArgumentError", "ConfigFileNotFound"}:
                print(f"jupyter gpupool: error: {err}", file=sys.stderr)
                sys.exit(EXIT_USAGE)
            raise


#: Subcommands typed as one hyphenated word.
_HYPHENATED = ("clear-claim",)


def command_words(app_name: str) -> str:
    """The command as typed: ``jupyter-gpupool-reserve`` → ``jupyter gpupool reserve``,
    ``jupyter-gpupool-clear-claim`` → ``jupyter gpupool clear-claim``."""
    words = app_name.replace("-", " ")
    for name in _HYPHENATED:
        words = words.replace(f" {name.replace('-', ' ')}", f" {name}")
    return words


class _OneLineParser(_KVArgParser):
    """traitlets' parser, raising InvalidInput where argparse would print its usage and exit."""

    command = "jupyter gpupool"
    option_names: dict[str, str] = {}

    known_options: set[str] = set()

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        # traitlets takes any --word for an option with a value: name a typo as what it is.
        match = re.match(r"argument (--[\w-]+): expected one argument", message)
        if match and match.group(1) not in self.known_options and "." not in match.group(1):
            message = f"unknown option {match.group(1)}"
        for long_name, short_name in self.option_names.items():
            message = re.sub(rf"{re.escape(long_name)}\b", short_name, message)
        raise InvalidInput(f"{message}; see `{self.command} --help`")


class _OneLineLoader(KVArgParseConfigLoader):
    parser_class = _OneLineParser  # type: ignore[assignment]

    def __init__(self, *args: Any, command: str = "jupyter-gpupool", **kwargs: Any) -> None:
        self.command = command_words(command)
        super().__init__(*args, **kwargs)

    def _create_parser(self) -> None:
        super()._create_parser()
        parser = self.parser
        assert isinstance(parser, _OneLineParser)
        parser.command = self.command
        parser.known_options = {
            f"--{name}"
            for table in (self.aliases or {}, self.flags or {})
            for key in table
            for name in (key if isinstance(key, tuple) else (key,))
        }
        parser.option_names = {
            f"--{target}": f"--{alias}"
            for alias, target in (self.aliases or {}).items()
            if isinstance(alias, str) and isinstance(target, str)
        }


NEGATIVE = re.compile(r"^-\d")


def negative_values_as_values(argv: list[str], aliases: Any) -> list[str]:
    """Let ``--for -1h`` and ``request -5GiB`` reach the value checks (which name the mistake)
    instead of argparse, which takes them for unknown options and prints its usage.

    ``--opt -1h`` becomes ``--opt=-1h``; a negative positional moves after ``--`` (the order of
    the other words is kept)."""
    names = {a for a in aliases if isinstance(a, str)} | {n for a in aliases if isinstance(a, tuple) for n in a}
    words: list[str] = []
    moved: list[str] = []
    rest: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            rest = argv[i:]
            break
        if NEGATIVE.match(word):
            previous = words[-1] if words else ""
            if previous.startswith("--") and "=" not in previous and (previous[2:] in names or "." in previous):
                words[-1] = f"{previous}={word}"
            else:
                moved.append(word)
            continue
        words.append(word)
    if not moved:
        return words + rest
    return words + (rest or ["--"])[:1] + moved + rest[1:]


__all__ = ["EXIT_USAGE", "GpuPoolBaseApp", "command_words", "current_user", "negative_values_as_values"]
