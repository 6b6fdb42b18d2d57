"""The ``sfmonitor`` command: train, report, replay, lr-find.

Each subcommand lives in its own module with ``main(argv: list[str]) -> int`` and its own argparse;
this file only dispatches, importing the module when its command is asked for.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("reference_model.train", "train the Superfusion reference model (see --help)"),
    "report": ("sfmonitor.tools.report", "render RUN_DIR's JSONL logs as one HTML file"),
    "replay": ("sfmonitor.replay", "rerun an anomaly bundle and locate the failure"),
    "lr-find": ("sfmonitor.tools.lr_find", "LR range test on the reference model"),
}


def usage() -> str:
    lines = ["usage: sfmonitor COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "`sfmonitor COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"sfmonitor: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
