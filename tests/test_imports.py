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
    return subprocess.run(
        [sys.executable, *(["-c", code] if code else []), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("module", ["reference_model", "reference_model.model", "reference_model.data"])
def test_the_reference_model_and_data_load_no_sfmonitor_module(module):
    code = (
        f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'sfmonitor' or m.startswith('sfmonitor.')))"
    )
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
    _registered(
        monkeypatch,
        EntryPoint("replay", "os:system", cli.COMMAND_GROUP),
        EntryPoint("report", "os:system", cli.COMMAND_GROUP),
    )
    assert cli.commands() == {}


def test_a_broken_registered_command_is_reported(monkeypatch, capsys):
    _registered(monkeypatch, EntryPoint("broken", "no_such_module_xyz:main", cli.COMMAND_GROUP))
    assert cli.main(["--help"]) == 0  # --help still works
    assert "cannot load no_such_module_xyz:main" in capsys.readouterr().out
    assert cli.main(["broken"]) == 2
    assert "cannot be loaded" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Every module of sfmonitor imports on its own, and the module-level import graph has no cycle.
# ------------------------------------------------------------------------------------------------
def _modules():
    out = []
    for folder, dirs, files in os.walk(PACKAGE):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
                out.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
    return sorted(out)


def test_every_module_imports_first_in_a_fresh_interpreter():
    # One interpreter per module, each importing that module first; four at a time.
    failures, procs = {}, []
    for module in _modules():
        procs.append(
            (
                module,
                subprocess.Popen(
                    [sys.executable, "-c", f"import importlib; importlib.import_module({module!r})"],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                ),
            )
        )
        while sum(p.poll() is None for _, p in procs) >= 4:
            procs[[p.poll() is None for _, p in procs].index(True)][1].wait()
    for module, proc in procs:
        _, err = proc.communicate(timeout=120)
        if proc.returncode != 0:
            failures[module] = err.strip().splitlines()[-1]
    assert not failures, failures


def _imports_of(module):
    """Modules of sfmonitor that ``module`` imports at module level (functions' imports are lazy)."""
    import ast

    path = os.path.join(ROOT, *module.split(".")) + ".py"
    if not os.path.exists(path):
        path = os.path.join(ROOT, *module.split("."), "__init__.py")
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in tree.body:  # top level only
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "sfmonitor"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "sfmonitor":
                continue
            for a in node.names:  # `from . import stats` names a submodule
                sub = f"{base}.{a.name}"
                found.add(sub if sub in MODULES else base)
    return found & set(MODULES)


MODULES = _modules()


def test_the_module_import_graph_has_no_cycle():
    graph = {m: _imports_of(m) for m in MODULES}
    assert graph["sfmonitor.schema"] <= {"sfmonitor.errors"}, "the schema imports no component"
    assert graph["sfmonitor.registry"] <= {"sfmonitor.errors", "sfmonitor.schema"}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in MODULES:
        if m not in state:
            visit(m)


def test_the_cycle_check_sees_a_cycle(monkeypatch):
    """The check above can fail: a graph with a cycle is reported."""
    fake = {"a": {"b"}, "b": {"a"}}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", list(fake))
    monkeypatch.setattr(sys.modules[__name__], "_imports_of", lambda m: fake[m])
    graph = {"sfmonitor.schema": set(), "sfmonitor.registry": set()}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", list(fake) + list(graph))
    fake.update(graph)
    with pytest.raises(AssertionError, match="import cycle: a -> b -> a"):
        test_the_module_import_graph_has_no_cycle()
