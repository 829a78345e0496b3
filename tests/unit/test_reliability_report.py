"""The RELIABILITY.md writer (tools/reliability_report.py) on small sample logs and JUnit reports: what it
reports as held, what as FAILED, how it keeps the previous run, and that findings carry their test."""

from __future__ import annotations

import datetime
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests import reliability

ROOT = Path(__file__).resolve().parents[2]
KILL_TEST = "tests/crash/test_kill_torture.py::test_torture_kills_lose_nothing_and_redo_nothing[sqlite]"
POWER_TEST = "tests/crash/test_power_cut.py::test_power_cuts[sqlite]"
INFO = {"cores": "2", "cpu": "Test CPU", "kernel": "Linux 6.1", "python": "3.11", "sqlite": "3.40",
        "postgresql": "15.5", "filesystem": "ext4 (/tmp)"}


def load_writer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "tools" / "reliability_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


writer = load_writer()


def finding(section: str, backend: str, case: str, seed: int, test: str, **figures: object) -> str:
    return json.dumps({"section": section, "backend": backend, "case": case, "seed": seed, "figures": figures,
                       "at": 0.0, "test": test})


def sample_log(path: Path, *, lost: int = 0) -> Path:
    zero = {"executed_after_commit": 0, "overlaps": 0, "fence_violations": 0, "integrity_failures": 0}
    path.write_text("\n".join([
        finding("kills", "sqlite", "command tasks, 1 worker", 11, KILL_TEST, kills=600, lost=lost, **zero),
        finding("kills", "sqlite", "steps tasks, 4 workers", 11, KILL_TEST, kills=500, lost=0,
                by_way={"random": 150, "reclaim": 50}, **zero),
        finding("kills", "postgres", "python tasks, 4 workers", 12, KILL_TEST.replace("sqlite", "postgres"),
                kills=1010, lost=0, **zero),
        finding("recovery", "sqlite", "kill -> next task started", 11, KILL_TEST, samples=80, median_s=0.41),
        finding("power cut", "sqlite", "EXT4_IOC_SHUTDOWN mid-run", 13, POWER_TEST, cuts=50, lost=0,
                integrity_failures=0),
    ]) + "\n")
    return path


def junit(path: Path, failed: list[str] = (), skipped: list[str] = ()) -> Path:  # type: ignore[assignment]
    cases = []
    for test in [KILL_TEST, KILL_TEST.replace("sqlite", "postgres"), POWER_TEST]:
        module, name = test.split("::")
        classname = module[:-3].replace("/", ".")
        inner = ""
        if test in failed:
            inner = '<failure message="AssertionError: seed 11: lost 1">trace</failure>'
        elif test in skipped:
            inner = '<skipped message="needs root" />'
        cases.append(f'<testcase classname="{classname}" name="{name}">{inner}</testcase>')
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite>{"".join(cases)}</testsuite></testsuites>')
    return path


def write(tmp_path: Path, log: Path, reports: list[Path], hour: int = 12) -> tuple[bool, str]:
    out = tmp_path / "RELIABILITY.md"
    held = writer.write_report(log, reports, out, ROOT, when=datetime.datetime(2026, 12, 1, hour, 0), info=INFO)
    return held, out.read_text()


def summary_row(text: str, section: str, backend: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(f"| {section} | {backend} |")]
    assert rows, f"no summary row for {section}/{backend}"
    return rows[0]


def test_a_run_that_held_reports_counts_seeds_and_machine(tmp_path: Path) -> None:
    held, text = write(tmp_path, sample_log(tmp_path / "log.jsonl"), [junit(tmp_path / "j.xml")])
    assert held
    assert "**Result: every test passed** (3 passed, 0 skipped)" in text
    # kills on SQLite: two findings, 1,100 kills, every breach 0.
    assert summary_row(text, "kills", "sqlite") == "| kills | sqlite | 2 | 1100 | 0 | 0 | 0 | 0 | 0 | held |"
    assert summary_row(text, "kills", "postgres").startswith("| kills | postgres | 1 | 1010 | 0 |")
    # A finding that does not measure a guarantee shows a dash, not a 0.
    assert summary_row(text, "power cut", "sqlite") == "| power cut | sqlite | 1 | 50 | 0 | — | — | — | 0 | held |"
    assert "random: 150, reclaim: 50" in text
    assert "11, 12, 13" in text
    assert "- cpu: Test CPU" in text and "- postgresql: 15.5" in text and "noisy" in text
    assert "## Run of 2026-12-01 12:00 UTC (commit " in text
    assert "make torture" in text and "ONWARD_TEST_SEED=<seed>" in text
    assert "FAILED" not in text.split("### Summary")[1]


def test_a_failed_test_is_never_reported_as_held(tmp_path: Path) -> None:
    held, text = write(tmp_path, sample_log(tmp_path / "log.jsonl"), [junit(tmp_path / "j.xml", failed=[KILL_TEST])])
    assert not held
    assert "**Result: FAILED.** 1 of 3 tests failed" in text
    assert f"- `{KILL_TEST}`: AssertionError: seed 11: lost 1" in text
    assert summary_row(text, "kills", "sqlite").endswith("| **FAILED** (2 of 2) |")
    assert summary_row(text, "kills", "postgres").endswith("| held |")
    assert summary_row(text, "recovery", "sqlite").endswith("| **FAILED** (1 of 1) |")


def test_a_breach_counted_marks_its_row_failed_even_when_the_test_passed(tmp_path: Path) -> None:
    held, text = write(tmp_path, sample_log(tmp_path / "log.jsonl", lost=2), [junit(tmp_path / "j.xml")])
    assert not held
    assert "**Result: FAILED.**" in text
    assert summary_row(text, "kills", "sqlite") == "| kills | sqlite | 2 | 1100 | 2 | 0 | 0 | 0 | 0 | **FAILED** (1 of 2) |"


def test_skipped_tests_are_listed_and_a_missing_report_is_a_failure(tmp_path: Path) -> None:
    held, text = write(tmp_path, sample_log(tmp_path / "log.jsonl"),
                       [junit(tmp_path / "j.xml", skipped=[POWER_TEST]), tmp_path / "never-written.xml"])
    assert not held
    assert f"- `{POWER_TEST}`: needs root" in text
    assert "never-written.xml" in text and "did not finish" in text


def test_unreadable_lines_and_an_empty_log_are_said(tmp_path: Path) -> None:
    log = sample_log(tmp_path / "log.jsonl")
    with log.open("a") as f:
        f.write('{"section": "kills", "backend"\n')
    held, text = write(tmp_path, log, [junit(tmp_path / "j.xml")])
    assert not held and "log.jsonl:6: unreadable finding" in text
    (tmp_path / "empty.jsonl").write_text("")
    held, text = write(tmp_path, tmp_path / "empty.jsonl", [])
    assert not held and "**Result: nothing recorded.**" in text


def test_the_previous_run_is_kept_and_only_one(tmp_path: Path) -> None:
    log = sample_log(tmp_path / "log.jsonl")
    write(tmp_path, log, [junit(tmp_path / "j.xml")], hour=10)
    write(tmp_path, log, [junit(tmp_path / "j.xml", failed=[POWER_TEST])], hour=11)
    _, text = write(tmp_path, log, [junit(tmp_path / "j.xml")], hour=12)
    current, previous = text.split("## Previous run")
    assert "## Run of 2026-12-01 12:00 UTC" in current and "every test passed" in current
    assert "### Run of 2026-12-01 11:00 UTC" in previous and "**Result: FAILED.**" in previous
    assert "10:00" not in text
    assert previous.count("#### Summary") == 1


def test_the_command_line_exits_1_on_failure(tmp_path: Path) -> None:
    log = sample_log(tmp_path / "log.jsonl", lost=1)
    out = tmp_path / "R.md"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "reliability_report.py"), "--log", str(log),
                           "--junit", str(junit(tmp_path / "j.xml")), "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "FAILED" in done.stderr and "**Result: FAILED.**" in out.read_text()


def test_record_names_the_test_that_found_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("ONWARD_RELIABILITY_LOG", str(log))
    reliability.record("kills", backend="sqlite", case="c", seed=5, kills=3, lost=0)
    row = json.loads(log.read_text())
    assert row["test"] == "tests/unit/test_reliability_report.py::test_record_names_the_test_that_found_it"
    assert row["figures"] == {"kills": 3, "lost": 0} and row["seed"] == 5


def test_without_a_test_report_nothing_is_called_held(tmp_path: Path) -> None:
    held, text = write(tmp_path, sample_log(tmp_path / "log.jsonl"), [])
    assert not held and "**Result: test outcomes unknown**" in text and "every test passed" not in text
