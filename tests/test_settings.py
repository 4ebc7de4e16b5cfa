"""mlac/settings.py: the one registry of the MLAC_* environment variables. Each type reads its text
or refuses it in one line naming the variable; a value is read once, at first use; `serve` logs the
settings not at their default, secrets masked; no other module of mlac reads an MLAC_* variable
from os.environ (read from the source with `ast`); docs/development.md's table is the registry."""

from __future__ import annotations

import ast
import logging
import socket
from pathlib import Path

import pytest
from _paths import REPO

from mlac import settings
from mlac.core.errors import MlacError
from mlac.settings import Setting

MLAC = REPO / "mlac"


def test_each_type_reads_its_text():
    flag = Setting("MLAC_X", "bool", False, "x")
    assert [flag.parse(t) for t in ("1", "true", "YES", "on", "0", "false", "No", "off")] == [True] * 4 + [
        False
    ] * 4
    assert Setting("MLAC_X", "int", 3, "x").parse("12") == 12
    assert Setting("MLAC_X", "str", None, "x").parse("a b") == "a b"
    assert Setting("MLAC_X", "choice", "a", "x", choices=("a", "b")).parse("b") == "b"
    assert Setting("MLAC_X", "list", (), "x").parse(" h:1, ,h:2 ") == ("h:1", "h:2")
    assert all(s.parse("") == s.default for s in settings.REGISTRY)  # empty is unset: the default


@pytest.mark.parametrize(
    "setting,text,message",
    [
        (Setting("MLAC_PDL", "bool", True, "x"), "maybe", "MLAC_PDL='maybe': say 1 or 0"),
        (Setting("MLAC_N", "int", 1, "x"), "two", "MLAC_N='two': not an integer"),
        (Setting("MLAC_C", "choice", "a", "x", choices=("a", "b")), "c", "MLAC_C='c': say a or b"),
        (Setting("MLAC_S", "int", 1, "x", secret=True), "hunter2", "MLAC_S=***: not an integer"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_the_variable(setting, text, message):
    with pytest.raises(MlacError) as err:
        setting.parse(text)
    assert str(err.value) == message


def test_a_bad_value_in_the_environment_fails_at_its_first_read(setting):
    setting("MLAC_PDL", "maybe")
    with pytest.raises(MlacError, match=r"^MLAC_PDL='maybe': say 1 or 0$"):
        settings.PDL.get()
    with pytest.raises(MlacError, match="MLAC_PDL"):
        settings.summary()  # serve's start-up line reads them all: it fails before the server starts


def test_read_once_until_reloaded(monkeypatch, setting):
    setting("MLAC_PDL", "0")
    assert settings.PDL.get() is False
    monkeypatch.setenv("MLAC_PDL", "1")
    assert settings.PDL.get() is False  # the value of the first use
    settings.reload()
    assert settings.PDL.get() is True


def test_summary_names_what_is_not_default_and_masks_secrets(setting):
    for s in settings.REGISTRY:
        setting(s.name, None)
    assert settings.summary() is None
    setting("MLAC_PDL", "0")
    setting("MLAC_API_KEY", "s3cret")
    setting("MLAC_REGISTRY_PASSWORD", "hunter2")
    setting("MLAC_INSECURE_REGISTRIES", "localhost:5000,r:1")
    line = settings.summary()
    assert line == (
        "settings: MLAC_API_KEY=***, MLAC_REGISTRY_PASSWORD=***, MLAC_INSECURE_REGISTRIES=localhost:5000,r:1,"
        " MLAC_PDL=0"
    )


def test_serve_logs_the_settings_not_at_their_default_in_one_line(artifact, monkeypatch, setting, caplog):
    from mlac.runtime.serve import launch
    from mlac.runtime.serve.config import ServerConfig

    class Started(Exception):
        """make_server reached: the start-up lines are logged."""

    def make_server(*args, **kwargs):
        raise Started

    for s in settings.REGISTRY:
        setting(s.name, None)
    setting("MLAC_API_KEY", "s3cret")
    setting("MLAC_PDL", "0")
    monkeypatch.setattr(launch, "make_server", make_server)
    monkeypatch.setattr(launch, "log_to_stderr", lambda level: None)  # caplog's handler, no other
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = ServerConfig.of(artifact=artifact("tiny-v3"), port=port, device="cpu")
    with caplog.at_level(logging.INFO, logger="mlac"), pytest.raises(Started):
        launch.serve(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("settings:")]
    assert lines == ["settings: MLAC_API_KEY=***, MLAC_PDL=0"]
    assert "s3cret" not in caplog.text


# ---- who reads the environment ----------------------------------------------------------------


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level names bound to a string (`NAME = "..."`, `A, B = "...", "..."`)."""
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=False))
            for name, value in pairs:
                if (
                    isinstance(name, ast.Name)
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    out[name.id] = value.value
    return out


def _is_environ(node: ast.AST) -> bool:
    """`os.environ` or a bare `environ`."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _keys(tree: ast.Module):
    """(line, key expression) of every read of the environment: os.environ[k], os.environ.get(k)
    (pop, setdefault), os.getenv(k), `k in os.environ`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            yield node.lineno, node.slice
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            reads = (
                isinstance(f, ast.Attribute)
                and f.attr in ("get", "pop", "setdefault")
                and _is_environ(f.value)
            )
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                isinstance(f, ast.Name) and f.id == "getenv"
            )
            if reads or getenv:
                yield node.lineno, node.args[0]
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            yield node.lineno, node.left


def mlac_reads(path: Path) -> list[str]:
    """`path:line NAME` for each read of an MLAC_* variable from the environment in the module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    constants, out = _constants(tree), []
    for line, key in _keys(tree):
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            name = key.value
        elif isinstance(key, ast.Name):
            name = constants.get(key.id, "")
        elif isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
            name = str(key.values[0].value)
        else:
            continue
        if name.startswith("MLAC_"):
            out.append(f"{path.name}:{line} {name}")
    return out


def test_the_scan_finds_every_form_of_read(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import os\nfrom os import environ, getenv\nA, B = 'MLAC_A', 'OTHER'\nC = 'MLAC_C'\n"
        "os.environ.get(A)\nos.environ['MLAC_B']\ngetenv(C)\nenviron.setdefault(f'MLAC_{A}', '1')\n"
        "'MLAC_D' in os.environ\nos.environ.get(B)\nos.environ.get('TRITON_INTERPRET')\n"
    )
    assert mlac_reads(planted) == [
        "planted.py:5 MLAC_A",
        "planted.py:6 MLAC_B",
        "planted.py:7 MLAC_C",
        "planted.py:8 MLAC_",
        "planted.py:9 MLAC_D",
    ]


def test_no_module_but_settings_reads_an_mlac_variable():
    reads = [
        r for path in sorted(MLAC.rglob("*.py")) if path != MLAC / "settings.py" for r in mlac_reads(path)
    ]
    assert reads == []


def test_every_setting_is_an_mlac_variable_named_once():
    names = [s.name for s in settings.REGISTRY]
    assert len(set(names)) == len(names) and all(n.startswith("MLAC_") for n in names)
    assert all(s.kind in settings.KINDS and s.doc and "\n" not in s.doc for s in settings.REGISTRY)


def test_the_docs_table_is_the_registry():
    """docs/development.md, "Adding a setting": one row per setting, in the registry's order."""
    text = (REPO / "docs" / "development.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `MLAC_")]
    want = [f"| `{s.name}` | {s.kind} | {s.shown(s.default)} | {s.doc} |" for s in settings.REGISTRY]
    assert rows == want
