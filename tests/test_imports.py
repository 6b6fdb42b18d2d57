"""One-way dependencies: reference_model may use sfmonitor, sfmonitor knows nothing of reference_model.

The reference model's commands (``sfmonitor train``, ``sfmonitor lr-find``) and its replay factory
reach sfmonitor through entry points (pyproject.toml); sfmonitor's own ``report`` and ``replay``
stay in its table.
"""
import os
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from sfmonitor import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "sfmonitor")


def _python(code, *args):
    return subprocess.run([sys.executable, *(["-c", code] if code else []), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", ["reference_model", "reference_model.model", "reference_model.data"])
def test_the_reference_model_and_data_load_no_sfmonitor_module(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m == 'sfmonitor' or m.startswith('sfmonitor.')))")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_file_of_sfmonitor_names_reference_model():
    hits = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as fh:
                if b"reference_model" in fh.read():
                    hits.append(os.path.relpath(path, ROOT))
    assert hits == []


def test_help_lists_builtin_and_registered_commands():
    out = _python(None, "-m", "sfmonitor.cli", "--help")
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert {"report", "replay", "train", "lr-find"} <= listed
    assert "cannot load" not in out.stdout


def test_the_reference_commands_come_from_entry_points():
    import reference_model.lr_find
    import reference_model.train
    registered = cli.commands()
    assert registered["train"].load() is reference_model.train.main
    assert registered["lr-find"].load() is reference_model.lr_find.main
    assert "report" in cli.BUILTINS and "replay" in cli.BUILTINS


def test_unknown_command_exits_2_with_a_clear_message(capsys):
    assert cli.main(["frobnicate", "--x"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'frobnicate'" in err and "replay" in err and "report" in err


def test_no_arguments_prints_usage_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: sfmonitor COMMAND" in capsys.readouterr().out


def _registered(monkeypatch, *eps):
    def fake(*, group):
        return [ep for ep in eps if ep.group == group]
    monkeypatch.setattr(cli, "entry_points", fake)


@pytest.mark.parametrize("cmd", ["lr-find", "train"])
def test_reference_commands_without_the_reference_model_say_so(monkeypatch, capsys, cmd):
    _registered(monkeypatch)
    assert cli.main([cmd, "--config", "trap"]) == 2
    err = capsys.readouterr().err
    assert f"command {cmd!r} is not installed" in err and cli.COMMAND_GROUP in err
    if cmd == "lr-find":
        assert "sfmonitor.lr_find(model, optimizer, loader, loss_fn)" in err


def _echo(argv):
    """echo the arguments"""
    print("echo:" + ",".join(argv))
    return 7


def test_a_registered_command_gets_its_arguments_and_help_line(monkeypatch, capsys):
    _registered(monkeypatch, EntryPoint("echo", f"{__name__}:_echo", cli.COMMAND_GROUP))
    assert cli.main(["echo", "a", "--b"]) == 7
    assert capsys.readouterr().out.strip() == "echo:a,--b"
    assert cli.main(["--help"]) == 0
    assert "echo the arguments" in capsys.readouterr().out


def test_a_registered_command_cannot_replace_a_builtin(monkeypatch):
    _registered(monkeypatch, EntryPoint("replay", "os:system", cli.COMMAND_GROUP),
                EntryPoint("report", "os:system", cli.COMMAND_GROUP))
    assert cli.commands() == {}


def test_a_broken_registered_command_is_reported(monkeypatch, capsys):
    _registered(monkeypatch, EntryPoint("broken", "no_such_module_xyz:main", cli.COMMAND_GROUP))
    assert cli.main(["--help"]) == 0                       # --help still works
    assert "cannot load no_such_module_xyz:main" in capsys.readouterr().out
    assert cli.main(["broken"]) == 2
    assert "cannot be loaded" in capsys.readouterr().err
