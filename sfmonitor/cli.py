"""The ``sfmonitor`` command: its own ``report`` and ``replay``, plus the commands packages register.

Each subcommand is a function ``main(argv: list[str]) -> int`` with its own argparse. sfmonitor's
own commands are in ``BUILTINS``; any installed package adds more through the entry point group
``sfmonitor.commands`` (name -> ``"module:main"``) in its pyproject.toml::

    [project.entry-points."sfmonitor.commands"]
    train = "mypackage.train:main"

The first line of that function's docstring is its line in ``sfmonitor --help``. A registered
command cannot replace a built-in one. A command's module is imported only when the command is
asked for (and, for its help line, by ``sfmonitor --help``).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

__all__ = ["BUILTINS", "COMMAND_GROUP", "commands", "main", "usage"]

COMMAND_GROUP = "sfmonitor.commands"
BUILTINS = {
    "report": ("sfmonitor.tools.report", "render RUN_DIR's JSONL logs as one HTML file"),
    "replay": ("sfmonitor.replay", "rerun an anomaly bundle and locate the failure"),
}
# Commands of the README that come from the reference model package: what to say when they are
# missing (an install without that package, or without its entry points).
KNOWN_PLUGINS = {
    "train": "trains the Superfusion reference model",
    "lr-find": "runs the LR range test on the Superfusion reference model; for your own model call "
    "sfmonitor.lr_find(model, optimizer, loader, loss_fn) from Python",
}


def commands() -> dict[str, EntryPoint]:
    """Registered commands (group ``sfmonitor.commands``), by name; built-in names are skipped and
    the first registration of a name wins."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name not in BUILTINS and ep.name not in found:
            found[ep.name] = ep
    return found


def _summary(ep: EntryPoint) -> str:
    try:
        fn = ep.load()
    except Exception as e:  # a broken plugin must not break --help
        return f"(cannot load {ep.value}: {type(e).__name__}: {e})"
    doc = inspect.getdoc(fn) or ""
    return doc.strip().splitlines()[0] if doc.strip() else f"({ep.value})"


def usage(registered: dict[str, EntryPoint] | None = None) -> str:
    registered = commands() if registered is None else registered
    rows = [(name, doc) for name, (_, doc) in BUILTINS.items()]
    rows += [(name, _summary(ep)) for name, ep in sorted(registered.items())]
    width = max(9, *(len(name) for name, _ in rows))
    lines = ["usage: sfmonitor COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}} {doc}" for name, doc in rows]
    lines += ["", "`sfmonitor COMMAND --help` for a command's options."]
    return "\n".join(lines)


def _resolve(cmd: str) -> Callable[[list[str]], int] | str:
    """The command's main function, or the message that says why there is none."""
    if cmd in BUILTINS:
        return importlib.import_module(BUILTINS[cmd][0]).main
    registered = commands()
    if cmd in registered:
        ep = registered[cmd]
        try:
            return ep.load()
        except (ImportError, AttributeError) as e:
            return f"sfmonitor: command {cmd!r} is registered as {ep.value!r} but cannot be loaded: {e}"
    if cmd in KNOWN_PLUGINS:
        return (
            f"sfmonitor: command {cmd!r} is not installed. It {KNOWN_PLUGINS[cmd]}. It comes "
            f"with the reference model package, which registers it under the "
            f"{COMMAND_GROUP!r} entry points: install the project with it (pip install -e . "
            f"in a checkout), then run `sfmonitor --help`."
        )
    return f"sfmonitor: unknown command {cmd!r}\n\n{usage(registered)}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    fn = _resolve(cmd)
    if isinstance(fn, str):
        print(fn, file=sys.stderr)
        return 2
    return int(fn(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
