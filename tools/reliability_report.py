"""Write RELIABILITY.md from the findings of one ``make torture`` run.

The torture, power-cut, fault-matrix and hostile-input tests append their findings to the file named by
``ONWARD_RELIABILITY_LOG``, one JSON object a line (``tests/reliability.py``: section, backend, case, seed,
figures, the test that recorded it). ``make torture`` also has pytest write a JUnit XML report of each of its
steps; this script reads both and writes the document: per class of fault and backend, what was done, how many
times, what held (lost = 0, executed after commit = 0, overlaps = 0, fence violations = 0, integrity
failures = 0), the recovery and watchdog figures, the seeds, how to reproduce, the machine, the date and
the commit.

A failed or errored test is never reported as held: the document says at the top that the run failed and
lists the failing tests, and every finding recorded by a failing test is marked FAILED. A count of a
breach above 0 is reported as it is, and marks its row FAILED too.

The previous run is kept: when the output file exists, its current run moves under "Previous run" (only
one previous run is kept).

Usage: ``python tools/reliability_report.py --log FILE [--junit XML ...] [--out RELIABILITY.md]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The counts of broken guarantees, in the order the document shows them.
BREACHES = ("lost", "executed_after_commit", "overlaps", "fence_violations", "integrity_failures")
BREACH_TITLES = {"lost": "lost", "executed_after_commit": "executed after commit", "overlaps": "overlaps",
                 "fence_violations": "fence violations", "integrity_failures": "integrity failures"}
# Other counts that must be 0 when a test reports them (shown in the detailed tables).
OTHER_BREACHES = ("stray_files", "keep_awake_wrong", "worker_errors", "reported_but_lost", "torn", "written_outside",
                  "store_changed", "doubled")
# The figure that says how many times a finding's fault was made: the first present is summed.
TIMES_FIGURES = ("kills", "cuts", "cycles", "cells", "examples", "samples", "runs")
RUN_BEGIN, RUN_END = "<!-- run:begin -->", "<!-- run:end -->"
PREVIOUS_HEADING = "## Previous run"
SECTION_ORDER = ("kills", "recovery", "watchdog", "power cut", "fault matrix", "hostile input")


@dataclass
class Finding:
    section: str
    backend: str
    case: str
    seed: int | None
    figures: dict[str, Any]
    test: str = ""
    failed: bool = False  # recorded by a test that failed, or a breach count above 0

    def breach_total(self) -> int:
        return sum(int(self.figures.get(k) or 0) for k in (*BREACHES, *OTHER_BREACHES)
                   if isinstance(self.figures.get(k), (int, float)))

    def times(self) -> int:
        for key in TIMES_FIGURES:
            value = self.figures.get(key)
            if isinstance(value, (int, float)):
                return int(value)
        return 1


@dataclass
class TestOutcomes:
    """What pytest said of each test of the run (JUnit XML)."""

    passed: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (test, reason)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test, first line of the failure)

    @property
    def failed_ids(self) -> set[str]:
        return {t for t, _ in self.failed}


def read_findings(path: Path) -> tuple[list[Finding], list[str]]:
    """The findings of the log, and a note for each line that could not be read (never silently dropped)."""
    findings: list[Finding] = []
    unreadable: list[str] = []
    if not path.exists():
        return findings, [f"{path}: no such file (no test recorded anything)"]
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            findings.append(Finding(str(row["section"]), str(row["backend"]), str(row["case"]), row.get("seed"),
                                    dict(row.get("figures") or {}), str(row.get("test") or "")))
        except (ValueError, KeyError, TypeError) as e:
            unreadable.append(f"{path}:{number}: unreadable finding ({type(e).__name__}: {e})")
    return findings, unreadable


def test_id(case: ET.Element, root: Path) -> str:
    """``tests/crash/test_x.py::test_name[param]`` (the form of pytest's node ids, which the findings carry)
    from a JUnit testcase, whose classname is the dotted module path, with the class of a test in a class."""
    parts = case.get("classname", "").split(".")
    name = case.get("name", "")
    for cut in range(len(parts), 0, -1):  # the module is the longest prefix that is a file
        module = "/".join(parts[:cut]) + ".py"
        if (root / module).exists():
            return "::".join([module, *parts[cut:], name])
    return "::".join(["/".join(parts) + ".py", name])


def read_junit(paths: Iterable[Path], root: Path) -> TestOutcomes:
    outcomes = TestOutcomes()
    for path in paths:
        try:
            report = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            outcomes.failed.append((str(path), f"no readable test report ({e}): the step did not finish"))
            continue
        for case in report.iter("testcase"):
            tid = test_id(case, root)
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            skipped = case.find("skipped")
            if bad is not None:
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                outcomes.failed.append((tid, message[0][:300] if message else "failed"))
            elif skipped is not None:
                outcomes.skipped.append((tid, (skipped.get("message") or "").strip()[:200]))
            else:
                outcomes.passed += 1
    return outcomes


def mark_failures(findings: list[Finding], outcomes: TestOutcomes) -> None:
    failed = outcomes.failed_ids
    for f in findings:
        if f.test and f.test in failed:
            f.failed = True
        if f.breach_total() > 0:
            f.failed = True


# --- the machine ------------------------------------------------------------------------------------------
def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cores": str(os.cpu_count()), "cpu": cpu, "kernel": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "postgresql": postgres_version(), "filesystem": filesystem(tempfile.gettempdir())}


def postgres_version() -> str:
    host = os.environ.get("ONWARD_TEST_PG_HOST", "127.0.0.1")
    port = os.environ.get("ONWARD_TEST_PG_PORT", "5432")
    try:
        import psycopg

        with psycopg.connect(host=host, port=port, user=os.environ.get("ONWARD_TEST_PG_USER", "postgres"),
                             dbname=os.environ.get("ONWARD_TEST_PG_DB", "test"), connect_timeout=3) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            return f"{row[0] if row else '?'} ({host}:{port})"
    except Exception as e:  # any failure: the document says the version is unknown, and why
        return f"unknown ({type(e).__name__})"


def filesystem(path: str) -> str:
    """The file system type of the mount holding ``path`` (where the tests' stores and --out folders live)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1].replace("\\040", " ")
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, parts[2]
    except (OSError, IndexError):
        pass
    return f"{kind} ({path})"


def git_commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


# --- the document -----------------------------------------------------------------------------------------
def cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {cell(v)}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def ordered_sections(findings: Sequence[Finding]) -> list[str]:
    present = list(dict.fromkeys(f.section for f in findings))
    return sorted(present, key=lambda s: (SECTION_ORDER.index(s) if s in SECTION_ORDER else len(SECTION_ORDER), s))


def summary_table(findings: Sequence[Finding]) -> list[str]:
    lines = ["| class of fault | backend | findings | times | " + " | ".join(BREACH_TITLES[b] for b in BREACHES)
             + " | verdict |", "|---|---|---:|---:|" + "---:|" * len(BREACHES) + "---|"]
    groups: dict[tuple[str, str], list[Finding]] = defaultdict(list)
    for f in findings:
        groups[(f.section, f.backend)].append(f)
    for section in ordered_sections(findings):
        for (sec, backend), group in sorted(groups.items()):
            if sec != section:
                continue
            totals = []
            for b in BREACHES:
                values = [f.figures[b] for f in group if isinstance(f.figures.get(b), (int, float))]
                totals.append(str(int(sum(values))) if values else "—")
            failed = [f for f in group if f.failed]
            verdict = f"**FAILED** ({len(failed)} of {len(group)})" if failed else "held"
            lines.append(f"| {cell(section)} | {cell(backend)} | {len(group)} | {sum(f.times() for f in group)} | "
                         + " | ".join(totals) + f" | {verdict} |")
    return lines


def section_tables(findings: Sequence[Finding]) -> list[str]:
    out: list[str] = []
    for section in ordered_sections(findings):
        out += ["", f"### {section}", ""]
        rows = [f for f in findings if f.section == section]
        keys: list[str] = []
        for f in rows:
            keys += [k for k in f.figures if k not in keys]
        first = [k for k in (*TIMES_FIGURES, *BREACHES, *OTHER_BREACHES) if k in keys]
        keys = first + [k for k in keys if k not in first]
        out.append("| backend | case | " + " | ".join(k.replace("_", " ") for k in keys) + " | seed | test | verdict |")
        out.append("|---|---|" + "---|" * len(keys) + "---|---|---|")
        for f in sorted(rows, key=lambda f: (f.backend, f.case)):
            out.append(f"| {cell(f.backend)} | {cell(f.case)} | " + " | ".join(cell(f.figures.get(k)) for k in keys)
                       + f" | {cell(f.seed)} | {cell(f.test) if f.test else '—'} | {'**FAILED**' if f.failed else 'held'} |")
    return out


def run_block(findings: Sequence[Finding], outcomes: TestOutcomes, unreadable: Sequence[str], info: dict[str, str],
              when: str, commit: str) -> str:
    failed_findings = [f for f in findings if f.failed]
    lines = [RUN_BEGIN, f"## Run of {when} (commit {commit})", ""]
    total_tests = outcomes.passed + len(outcomes.failed) + len(outcomes.skipped)
    if outcomes.failed or failed_findings or unreadable:
        lines.append(f"**Result: FAILED.** {len(outcomes.failed)} of {total_tests} tests failed or did not finish,"
                     f" {len(failed_findings)} finding(s) show a breach or come from a failing test; those are"
                     " marked FAILED below and are not reported as held.")
    elif not findings:
        lines.append("**Result: nothing recorded.** No test recorded a finding: this run proves nothing.")
    elif not total_tests:
        lines.append("**Result: test outcomes unknown** (no JUnit report was given): these figures are not"
                     " reported as held.")
    else:
        lines.append(f"**Result: every test passed** ({outcomes.passed} passed, {len(outcomes.skipped)} skipped),"
                     " and every count of a broken guarantee is 0.")
    if outcomes.failed:
        lines += ["", "Failed tests:", ""] + [f"- `{t}`: {cell(m)}" for t, m in outcomes.failed]
    if unreadable:
        lines += ["", "Unreadable input:", ""] + [f"- {u}" for u in unreadable]
    if outcomes.skipped:
        lines += ["", "Skipped tests (not part of these figures):", ""] + [f"- `{t}`: {cell(m)}"
                                                                           for t, m in outcomes.skipped]
    lines += ["", "### Summary", "",
              "Times: the sum of each finding's count of faults made (kills, power cuts, cycles, cells,"
              " examples or samples); a dash: the finding does not measure that guarantee.", ""]
    lines += summary_table(findings)
    lines += section_tables(findings)
    seeds = sorted({f.seed for f in findings if f.seed is not None})
    lines += ["", "### Seeds", "", ", ".join(str(s) for s in seeds) if seeds else "none recorded",
              "", "### Machine", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += ["- shared: other work ran on this machine at the same time, so the times (recovery, detection,"
              " seconds) are noisy; the counts are not.", RUN_END]
    return "\n".join(lines)


HEADER = """# Reliability

What onward's torture tests did on one machine and what held, written by `make torture` from the run it
just did (`tools/reliability_report.py`; do not edit by hand). Each row was measured: the counts are the
checkers' own (tests/crash/kill_checker.py and the other torture tests), never constants.

- **lost**: a task not done, or whose result or `--out` file is wrong or missing.
- **executed after commit**: a task (or a durable step) run again after its completion (record) was committed.
- **overlaps**: two executions of one task alive at the same time.
- **fence violations**: a completion committed by a claim that no longer held the task.
- **integrity failures**: `PRAGMA integrity_check` (SQLite), constraints and counts (both backends).

Reproduce: `make torture` (all of it; writes this file). One test, with the seed of its row:
`ONWARD_TEST_SEED=<seed> .venv/bin/python -m pytest -s -m torture '<test>'` (the `-m torture` is needed for
the torture-scale tests; the others run in `make test`).
"""


def previous_run(old: str) -> str | None:
    """The current run of an existing document (to become its previous run), headings one level down."""
    begin, end = old.find(RUN_BEGIN), old.find(RUN_END)
    if begin < 0 or end < begin:
        return None
    body = old[begin + len(RUN_BEGIN):end].strip("\n")
    return "\n".join("#" + line if line.startswith("##") else line for line in body.splitlines())


def write_report(log: Path, junit: Sequence[Path], out: Path, root: Path, when: datetime.datetime | None = None,
                 info: dict[str, str] | None = None) -> bool:
    """Write the document; True when the run held (every test passed, every breach count 0)."""
    findings, unreadable = read_findings(log)
    outcomes = read_junit(junit, root)
    mark_failures(findings, outcomes)
    stamp = (when or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%d %H:%M UTC")
    block = run_block(findings, outcomes, unreadable, info if info is not None else machine(), stamp,
                      git_commit(root))
    previous = previous_run(out.read_text()) if out.exists() else None
    text = HEADER + "\n" + block + "\n"
    if previous:
        text += f"\n{PREVIOUS_HEADING}\n\n{previous}\n"
    temp = out.with_name(out.name + ".tmp")
    temp.write_text(text)
    os.replace(temp, out)
    ran = outcomes.passed + len(outcomes.failed) + len(outcomes.skipped)
    return not (outcomes.failed or unreadable or any(f.failed for f in findings)) and bool(findings) and bool(ran)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write RELIABILITY.md from a make torture run.")
    parser.add_argument("--log", required=True, type=Path, help="the JSON lines of $ONWARD_RELIABILITY_LOG")
    parser.add_argument("--junit", nargs="*", default=[], type=Path, help="pytest --junitxml reports of the run")
    parser.add_argument("--out", default=Path("RELIABILITY.md"), type=Path)
    args = parser.parse_args(argv)
    held = write_report(args.log, args.junit, args.out, Path(__file__).resolve().parents[1])
    print(f"{args.out}: {'every test passed, nothing broken' if held else 'FAILED or nothing recorded (see the file)'}",
          file=sys.stderr)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())

