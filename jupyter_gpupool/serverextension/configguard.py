"""An invalid setting never makes the server extension fail open.

traitlets rejects an invalid value (``c.GpuPoolExtension.when_unavailable = "bogus"``, a string
where a number goes, ``c.EnforcementSettings.framework_caps = "maybe"``) by raising where the
value is loaded, and jupyter_server then logs a traceback and goes on without the extension or
with part of it: the server exits (a bad value in ``jupyter_gpupool_config.py``), the extension
does not load at all so kernels start unpooled with every GPU (a bad ``c.EnforcementSettings``),
the admin's other ``c.GpuPoolExtension`` settings are silently dropped, or the watchdog never
starts (a bad ``c.Watchdog``).

Here, inside a server, each of our settings is checked on its own while the extension links:
an invalid one is dropped (so nothing later raises on it) and recorded, and the extension loads
in its degraded mode with the reason: the pool stays unavailable, kernels start CPU-only or are
refused (``when_unavailable``), and the log and ``GET /api/gpupool/pool`` say which setting is
wrong and what it accepts. Outside a server (``GpuPoolExtension(config=...)`` in a config
checker) an invalid value still raises, as traitlets does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from traitlets import Enum, TraitError, validate
from traitlets.config import Config, Configurable
from traitlets.config.loader import DeferredConfig

from jupyter_gpupool.configref import CONFIGURABLES, _load
from jupyter_gpupool.errors import GpuPoolError, PoolUnavailable

#: Settings of the extension that are a number of seconds and must be more than 0.
POSITIVE_SECONDS = ("tick_interval", "reconcile_interval", "retry_interval", "keepalive_default")
#: The broker's classes: a Jupyter server never reads them.
_NOT_READ_BY_A_SERVER = ("jupyter_gpupool.broker.",)
#: Problems named in the one-line reason; more are counted.
_SHOWN = 3


class InvalidConfig(PoolUnavailable):
    """A ``c.<Class>.<trait>`` value the server was given is invalid: the pool stays unavailable until it is fixed."""


@dataclass(frozen=True)
class ConfigProblem:
    """One invalid setting: where it is, what it was, what would be accepted."""

    section: str
    trait: str
    value: str
    accepted: str

    def __str__(self) -> str:
        return f"c.{self.section}.{self.trait} = {self.value} ({self.accepted})"


def _shown_value(raw: Any) -> str:
    """The value as the admin wrote it, on one line and at most 60 characters."""
    text = repr(str(raw)) if isinstance(raw, DeferredConfig) and isinstance(raw, str) else repr(raw)
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."


def _accepted(trait: Any, err: BaseException) -> str:
    """What the trait accepts, from the trait and traitlets' (or our validator's) error."""
    if isinstance(trait, Enum) and trait.values:
        return "must be one of " + ", ".join(repr(v) for v in trait.values)
    if not isinstance(err, (TraitError, GpuPoolError)):  # e.g. float("x") of a command-line value
        return f"must be {trait.info()}"
    text = " ".join(str(err).split())
    # "The 'x' trait of a Cls instance expected a float, not the str 'y'." → "expected a float, not the str 'y'"
    text = re.sub(r"^The (value of the )?'\w+' trait of an? \w+ instance ", "", text).rstrip(".")
    return text or f"must be {trait.info()}"


def value_problem(target: Configurable, name: str, raw: Any) -> ConfigProblem | None:
    """Load ``raw`` into ``target``'s trait ``name`` as traitlets would; the problem if it is refused.

    ``target`` is changed when the value is valid: pass the real object, or a bare probe
    (``cls.__new__(cls)``, whose ``__init__`` never runs).
    """
    section = type(target).__name__
    trait = target.traits(config=True).get(name)
    if trait is None:
        return None  # not a setting of this class: traitlets warns about unknown names itself
    try:
        Configurable._load_config(target, Config({section: {name: raw}}), traits={name: trait})
    except Exception as err:  # noqa: BLE001 - TraitError, our validators' InvalidInput, ValueError of a CLI string
        return ConfigProblem(section, name, _shown_value(raw), _accepted(trait, err))
    return None


def drop_invalid(configs: Iterable[Config], classes: Iterable[type[Configurable]]) -> list[ConfigProblem]:
    """Remove from each of ``configs`` the values of ``classes``' settings that are invalid; say which.

    Each value is tried on a bare instance (no ``__init__``: a Slurm pool would open its state
    file), so nothing is built; the values left are exactly those traitlets will accept.
    """
    configs = list(configs)
    problems: dict[tuple[str, str], ConfigProblem] = {}
    for cls in classes:
        section = cls.__name__
        for config in configs:
            if not config._has_section(section):
                continue
            for name, raw in list(config[section].items()):
                problem = value_problem(cls.__new__(cls), name, raw)
                if problem is not None:
                    problems.setdefault((section, name), problem)
                    del config[section][name]
    return list(problems.values())


def server_configurables() -> list[type[Configurable]]:
    """Every class of ours whose settings a Jupyter server reads (those of the config reference, less the broker's)."""
    return [_load(path) for path, _ in CONFIGURABLES if not path.startswith(_NOT_READ_BY_A_SERVER)]


def reason_for(problems: list[ConfigProblem]) -> str:
    """The one-line reason the pool stays unavailable."""
    shown = "; ".join(str(p) for p in problems[:_SHOWN])
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return f"invalid configuration: {shown}{more}; fix it and restart the server"


class FailClosedConfig:
    """Mixin for the server extension (before ``ExtensionApp`` in its bases): invalid settings
    leave it loaded and degraded instead of unloaded, half-loaded or the server exited."""

    _config_problems: list[ConfigProblem]
    #: True once linked to a server: from then on an invalid value is recorded, never raised.
    _tolerate_invalid_config: bool = False

    @property
    def config_problems(self) -> list[ConfigProblem]:
        """The invalid settings found so far (the extension's own first), without repeats."""
        if "_config_problems" not in self.__dict__:
            self._config_problems = []
        return self._config_problems

    def _note_problems(self, problems: Iterable[ConfigProblem]) -> None:
        known = {(p.section, p.trait) for p in self.config_problems}
        for problem in problems:
            if (problem.section, problem.trait) not in known:
                known.add((problem.section, problem.trait))
                self.config_problems.append(problem)

    def _load_config(
        self, cfg: Config, section_names: list[str] | None = None, traits: dict[str, Any] | None = None
    ) -> None:
        """As traitlets loads settings, but once linked to a server one value at a time: an invalid
        one keeps the default and is recorded (traitlets would raise and drop the valid ones too)."""
        if not self._tolerate_invalid_config:
            super()._load_config(cfg, section_names=section_names, traits=traits)  # type: ignore[misc]
            return
        own = self.traits(config=True) if traits is None else traits  # type: ignore[attr-defined]
        mine = self._find_my_config(cfg)  # type: ignore[attr-defined]
        unknown = Config({type(self).__name__: {k: v for k, v in mine.items() if k not in own}})
        if unknown[type(self).__name__]:
            super()._load_config(unknown, section_names=section_names, traits=own)  # type: ignore[misc]  # traitlets warns
        for name, raw in mine.items():
            if name in own:
                problem = value_problem(self, name, raw)  # type: ignore[arg-type]
                if problem is not None:
                    self._note_problems([problem])

    def _link_jupyter_server_extension(self, serverapp: Any) -> None:
        """Link (loading our settings tolerantly), then drop every invalid setting of our other
        classes from the server's config and ours, so nothing built later raises on one."""
        self._tolerate_invalid_config = True
        try:
            super()._link_jupyter_server_extension(serverapp)  # type: ignore[misc]
        finally:
            configs = [serverapp.config, self.config]  # type: ignore[attr-defined]
            others = [cls for cls in server_configurables() if not isinstance(self, cls)]
            self._note_problems(drop_invalid(configs, others))
            for problem in self.config_problems:
                for config in configs:  # the extension's own: the value it could not take
                    if problem.section == type(self).__name__ and config._has_section(problem.section):
                        config[problem.section].pop(problem.trait, None)

    def raise_for_invalid_config(self) -> None:
        """Raise :class:`InvalidConfig` with the reason while any setting is invalid (the pool must not open)."""
        if self.config_problems:
            raise InvalidConfig(reason_for(self.config_problems))

    @validate(*POSITIVE_SECONDS)
    def _check_positive_seconds(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not value > 0:
            raise TraitError("must be more than 0 seconds")
        return value
