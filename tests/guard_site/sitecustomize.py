"""The suite guard's write watch, in every Python process the tests start (tests/suite_guard.py puts
this folder first on ``PYTHONPATH``; the guard loads the same code into pytest's own process).

An audit hook records each write, creation, removal or rename of a path under the folders named in
``$SUITE_GUARD_WRITES_WATCHED`` (the real home: the tests run with a private ``HOME``, so nothing of
theirs belongs there), less those in ``$SUITE_GUARD_WRITES_SKIPPED`` (the interpreter's own folders)
and compiled-bytecode caches, as one JSON line in ``$SUITE_GUARD_WRITES_LOG`` with the process and
the test that ran it (``$PYTEST_CURRENT_TEST``). A process the tests did not start has no hook: what
it writes is never taken for the tests'. Any ``sitecustomize`` this one hides still runs.
"""

from __future__ import annotations

import os
import sys

_LOG = "SUITE_GUARD_WRITES_LOG"
_WATCHED = "SUITE_GUARD_WRITES_WATCHED"
_SKIPPED = "SUITE_GUARD_WRITES_SKIPPED"
#: open() flags that write or create.
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: Audit events that change a path (the index of each path argument).
_CHANGES = {"os.mkdir": (0,), "os.rename": (0, 1), "os.remove": (0,), "os.rmdir": (0,), "os.symlink": (1,),
            "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
            "shutil.rmtree": (0,), "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,),
            "sqlite3.connect": (0,)}


def install_write_watch() -> bool:
    """Install the audit hook where the guard asked for one (its variables set); True if installed."""
    log = os.environ.get(_LOG)
    watched = tuple(os.path.join(p, "") for p in os.environ.get(_WATCHED, "").split(os.pathsep) if p)
    if not log or not watched:
        return False
    skipped = tuple(os.path.join(p, "") for p in os.environ.get(_SKIPPED, "").split(os.pathsep) if p)
    busy = [False]

    def record(event: str, path: object) -> None:
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        elif hasattr(path, "__fspath__"):
            path = os.fspath(path)  # type: ignore[call-overload]
        if not isinstance(path, str) or path == ":memory:" or path.startswith("file:"):
            return
        full = os.path.abspath(path)
        inside = os.path.join(full, "")
        if not inside.startswith(watched) or inside.startswith(skipped) or "/__pycache__/" in inside:
            return
        import json

        line = json.dumps({"path": full, "event": event, "pid": os.getpid(), "argv": sys.argv[:3],
                           "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)

    def hook(event: str, args: tuple[object, ...]) -> None:
        if busy[0]:
            return
        if event == "open":
            if len(args) < 3 or not isinstance(args[2], int) or not args[2] & _WRITING:
                return
            where: tuple[int, ...] = (0,)
        else:
            where = _CHANGES.get(event, ())
            if not where:
                return
        busy[0] = True
        try:
            for index in where:
                if index < len(args):
                    record(event, args[index])
        except Exception:  # noqa: BLE001,S110 -- a watch must never break the process it watches
            pass
        finally:
            busy[0] = False

    sys.addaudithook(hook)
    return True


def _run_the_hidden_sitecustomize() -> None:
    """Run the ``sitecustomize`` this module hides on ``sys.path``, if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":
    install_write_watch()
    _run_the_hidden_sitecustomize()
