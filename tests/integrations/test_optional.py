"""The integrations stay optional: with the frameworks made unimportable (None in ``sys.modules``, as if
not installed), ``import onward``, a job with steps and the CLI still work, and importing an integration
fails with one line naming the extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FRAMEWORKS = ["openai", "anthropic", "pydantic_ai", "agents", "pydantic", "pydantic_core", "httpx"]
BLOCK = f"import sys\nfor name in {FRAMEWORKS!r}:\n    sys.modules[name] = None\n"

JOB = BLOCK + '''
from onward import Job, step
job = Job(sys.argv[1], log_level=0)

@step
def double(x):
    return 2 * x

@job.task
def task(name, ctx):
    return double(21)

job.add(["t"])
assert job.run().exit_code == 0 and job.result("t") == 42
assert not any(name in sys.modules and sys.modules[name] is not None for name in {frameworks!r})
from onward.cli import cli_main
sys.argv = ["onward", "steps", "--db", sys.argv[1], "t"]
cli_main()
'''.replace("{frameworks!r}", repr(FRAMEWORKS))


def test_onward_works_without_the_frameworks(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-c", JOB, str(tmp_path / "job.db")], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "double#1" in p.stdout


@pytest.mark.parametrize(("module", "extra"), [("openai", "openai"), ("anthropic", "anthropic"),
                                                ("pydantic_ai", "pydantic-ai"),
                                                ("openai_agents", "openai-agents")])
def test_an_integration_without_its_framework_names_the_extra(module: str, extra: str) -> None:
    p = subprocess.run([sys.executable, "-c", BLOCK + f"import onward.integrations.{module}"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: onward.integrations.{module} needs ")
    assert last.endswith(f"pip install 'onward[{extra}]'")


def test_import_onward_imports_no_framework() -> None:
    code = ("import sys, onward, onward.cli, onward.integrations, onward.integrations.calls\n"
            f"print([m for m in {FRAMEWORKS!r} if m in sys.modules])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
