"""tools/check_imports.py (run by `make check`): onward's import graph has no cycle, the runner knows no
backend, nothing above the store imports a backend, and the store imports nothing above it. Also run on
small made-up packages, to show that each rule does catch what it is meant to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_imports.py"


def check(src: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(CHECK)] + ([str(src)] if src is not None else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A made-up ``onward`` package under ``tmp_path/src``: ``files`` maps module paths to their source."""
    src = tmp_path / "src"
    for name, text in {"onward/__init__.py": "", "onward/store/__init__.py": "", **files}.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


def test_onward_import_graph_has_no_cycle_and_keeps_its_layers() -> None:
    result = check()
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_a_cycle_through_type_checking_and_function_local_imports_is_found(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/context.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .steps import Log\n",
        "onward/steps.py": "def f():\n    from . import context\n",
    })
    result = check(src)
    assert result.returncode == 1
    assert "import cycle: onward.context -> onward.steps -> onward.context" in result.stderr


def test_a_cycle_through_a_module_loaded_by_name_is_found(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/cli.py": 'LAZY = {"supervise": ("onward.deploy_cli", "command")}\n',
        "onward/deploy_cli.py": "from onward.cli import FINITE_FLOAT\n",
    })
    result = check(src)
    assert result.returncode == 1
    assert "import cycle: onward.cli -> onward.deploy_cli -> onward.cli" in result.stderr


def test_a_module_name_only_compared_with_is_not_an_import(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/cli.py": "from . import supervise\n",
        "onward/supervise.py": 'def is_onward(word):\n    return word in ("onward.cli",)\n',
    })
    assert check(src).returncode == 0


def test_a_runner_that_reaches_a_backend_is_refused(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/runner.py": "from .helpers import x\n",
        "onward/helpers.py": "from .store.sqlite import SqliteStore\n",
        "onward/store/sqlite.py": "",
    })
    result = check(src)
    assert result.returncode == 1
    assert "onward.runner imports the backend onward.store.sqlite" in result.stderr


def test_a_store_module_importing_above_the_store_is_refused(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/store/base.py": "from ..errors import StoreError\n",
        "onward/store/sqlite.py": "from .base import Store\nfrom ..proc import hostname\n",
        "onward/store/postgres.py": "from .base import Store\nfrom ..status import render\n",
        "onward/errors.py": "", "onward/proc.py": "from .store.base import Owner\n", "onward/status.py": "",
    })
    result = check(src)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "check_imports: onward.store.postgres imports onward.status, which is above the store layer"]


def test_a_module_above_the_store_importing_a_backend_is_refused(tmp_path: Path) -> None:
    src = package(tmp_path, {
        "onward/commands.py": "from .store.sqlite import path_from_url\n",
        "onward/status.py": "from .store import open_store\n",
        "onward/store/sqlite.py": "",
    })
    result = check(src)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "check_imports: onward.commands imports the backend onward.store.sqlite"
        " (use onward.store's open_store/exists/upgrade)"]
