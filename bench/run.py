"""Run every benchmark (``bench/bench_*.py``) and write BENCHMARKS.md: what ``make bench`` does.

Each script is run as a subprocess with this interpreter and prints one Markdown section on stdout (its
progress goes to stderr). This file adds a header -- date, machine, the measured cost of an fsync on the
disk holding the benchmark folder, how to reproduce -- then every section in name order. A script that
fails is reported as failed, with the tail of its stderr; it is never silently dropped.

    python bench/run.py                      # everything, writes BENCHMARKS.md
    python bench/run.py --only core          # one script (bench_core.py); the other sections of an
                                             # existing BENCHMARKS.md are kept, marked as from their run
    python bench/run.py --quick --out F.md   # smoke run (small N) into another file

Scripts see ``--quick`` (smoke run) and, in their environment, ``ONWARD_BENCH_DIR``: where to create
their temporary stores (on the disk whose fsync cost the header reports).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_OUT = REPO / "BENCHMARKS.md"
QUICK_OUT = BENCH / "out" / "BENCHMARKS.quick.md"
DEFAULT_BENCH_DIR = BENCH / "out"
STDERR_TAIL_LINES = 40
SCRIPT_TIMEOUT = {False: 3 * 3600, True: 900}  # seconds, full / quick: a hung script is a failed one
SECTION_START = re.compile(r"^<!-- section (?P<name>\S+) ran=(?P<ran>\S+) -->$")
SECTION_END = "<!-- end section -->"
KEPT_NOTE = re.compile(r"^_Kept from the run of \S+; not rerun this time\._$")


# --- the machine -------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def filesystem_of(path: Path) -> str:
    """The mount holding ``path`` (device, type, mount point), from /proc/mounts."""
    best = ("", "", "")
    try:
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[1]):
                best = (device, mount, fstype)
    except OSError:
        return "unknown"
    return f"{best[2]} on {best[0]} (mounted at {best[1]})" if best[1] else "unknown"


def fsync_cost(directory: Path, samples: int = 200) -> tuple[float, float]:
    """Median and 90th percentile (ms) of ``os.fsync`` after appending 4 KiB, on the disk of ``directory``:
    about what one durable SQLite WAL commit must pay at least."""
    fd, path = tempfile.mkstemp(prefix="fsync-", dir=directory)
    block = os.urandom(4096)
    times = []
    try:
        for _ in range(samples):
            os.write(fd, block)
            t = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - t)
    finally:
        os.close(fd)
        os.unlink(path)
    times.sort()
    return statistics.median(times) * 1e3, times[int(len(times) * 0.9)] * 1e3


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" with uncommitted changes" if dirty else "")


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def machine_rows(bench_dir: Path) -> list[tuple[str, str]]:
    fsync_median, fsync_p90 = fsync_cost(bench_dir)
    return [
        ("CPU", cpu_model()),
        ("cores", f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})"),
        ("memory", memory_gib()),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("Python", f"{platform.python_implementation()} {platform.python_version()} ({sys.executable})"),
        ("SQLite", f"{sqlite3.sqlite_version} (the library Python's sqlite3 module uses)"),
        ("onward", f"git {git_revision()}"),
        ("benchmark folder", f"{bench_dir} -- {filesystem_of(bench_dir)}"),
        ("fsync", f"median {fsync_median:.3f} ms, p90 {fsync_p90:.3f} ms (200 × `os.fsync` after a 4 KiB write,"
                  " in the benchmark folder)"),
        ("load average at start", f"{load_average()} (1, 5, 15 min)"),
    ]


# --- running the scripts -----------------------------------------------------------------------------
def scripts() -> dict[str, Path]:
    """``core`` -> bench/bench_core.py, in name order."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH.glob("bench_*.py"))}


def script_command(path: Path, quick: bool) -> list[str]:
    return [sys.executable, str(path.relative_to(REPO))] + (["--quick"] if quick else [])


def child_env(bench_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    # Measure this tree's onward even when run with a Python where it is not installed.
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["ONWARD_BENCH_DIR"] = str(bench_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Outcome:
    def __init__(self, name: str, command: list[str], code: int | None, seconds: float, stdout: str,
                 stderr: str) -> None:
        self.name, self.command, self.code, self.seconds = name, command, code, seconds
        self.stdout, self.stderr = stdout, stderr

    @property
    def ok(self) -> bool:
        return self.code == 0 and bool(self.stdout.strip())


def run_script(name: str, path: Path, quick: bool, env: dict[str, str]) -> Outcome:
    command = script_command(path, quick)
    print(f"== {name}: {shlex.join(command)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []

    def tee_stderr() -> None:  # the script's progress, shown live and kept for a failure report
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            sys.stderr.write(f"   {name}: {line}")
            sys.stderr.flush()

    def read_stdout() -> None:
        assert proc.stdout is not None
        out.append(proc.stdout.read())

    threads = [threading.Thread(target=tee_stderr, daemon=True), threading.Thread(target=read_stdout, daemon=True)]
    for t in threads:
        t.start()
    code: int | None
    try:
        code = proc.wait(timeout=SCRIPT_TIMEOUT[quick])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        err.append(f"[bench/run.py: killed after {SCRIPT_TIMEOUT[quick]} s]\n")
        code = None
    for t in threads:
        t.join(timeout=10)
    seconds = time.monotonic() - started
    print(f"== {name}: exit {code} after {seconds:.0f} s", file=sys.stderr, flush=True)
    return Outcome(name, command, code, seconds, "".join(out), "".join(err))


def section_text(outcome: Outcome) -> str:
    if outcome.ok:
        return outcome.stdout.strip() + "\n"
    why = "timed out" if outcome.code is None else f"exit status {outcome.code}"
    if outcome.code == 0:
        why = "exit status 0 but no output"
    tail = "".join(outcome.stderr.splitlines(keepends=True)[-STDERR_TAIL_LINES:]).rstrip()
    parts = [f"## {outcome.name}: FAILED\n",
             f"`{shlex.join(outcome.command)}` failed ({why}, after {outcome.seconds:.0f} s). Last lines of its"
             " stderr:\n", "```text\n" + (tail or "(empty)") + "\n```\n"]
    if outcome.stdout.strip():
        parts += ["What it printed before failing:\n", outcome.stdout.strip() + "\n"]
    return "\n".join(parts)


# --- the report --------------------------------------------------------------------------------------
def kept_sections(out: Path, skip: set[str]) -> dict[str, tuple[str, str]]:
    """Sections of an existing report, by name: (date it ran, text), except those in ``skip``."""
    if not out.exists():
        return {}
    found: dict[str, tuple[str, str]] = {}
    current: tuple[str, str] | None = None
    lines: list[str] = []
    for line in out.read_text().splitlines():
        start = SECTION_START.match(line)
        if start:
            current, lines = (start["name"], start["ran"]), []
        elif line == SECTION_END and current is not None:
            if current[0] not in skip:
                found[current[0]] = (current[1], "\n".join(lines).strip() + "\n")
            current = None
        elif current is not None and not KEPT_NOTE.match(line):
            lines.append(line)  # (a kept section's note is written afresh, not piled up run after run)
    return found


def report(started: datetime.datetime, machine: list[tuple[str, str]], quick: bool, only: str | None,
           outcomes: list[Outcome], kept: dict[str, tuple[str, str]], all_scripts: dict[str, Path]) -> str:
    stamp = started.strftime("%Y-%m-%d %H:%M UTC")
    ran = started.strftime("%Y-%m-%dT%H:%MZ")
    lines = ["# Benchmarks", "",
             f"Written by `bench/run.py` ({'quick smoke run, small N: not for comparison' if quick else 'full run' if not only else f'a run of `{only}` only'})"
             f" on {stamp}. Every figure below was measured in that run unless its section says otherwise;"
             " medians over several runs, each section says how many.", "",
             "## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in machine]
    lines += ["", "## How to reproduce", "",
              "```sh",
              "make bench                                # = .venv/bin/python bench/run.py: every script,"
              " writes BENCHMARKS.md",
              ".venv/bin/python bench/run.py --only NAME # one script; keeps the other sections of BENCHMARKS.md",
              ".venv/bin/python bench/run.py --quick --out /tmp/bench-quick.md  # smoke run (small N)",
              "```", "",
              "Each script also runs on its own and prints its Markdown section on stdout (temporary stores go"
              " under `$ONWARD_BENCH_DIR`, default `bench/out/`):", "",
              "```sh"]
    for path in all_scripts.values():
        lines.append(f".venv/bin/python {path.relative_to(REPO)} [--quick]")
    lines += ["```", ""]
    if only:
        lines += [f"This run ran only `{only}`" + ("; other sections are kept from earlier runs (dated in each)."
                                                   if kept else "."), ""]
    sections: list[tuple[str, str, str | None]] = [(o.name, section_text(o), None) for o in outcomes]
    sections += [(name, text, when) for name, (when, text) in kept.items()]
    for name, text, when in sorted(sections, key=lambda s: s[0]):
        lines.append(f"<!-- section {name} ran={when or ran} -->")
        if when:
            lines += [f"_Kept from the run of {when}; not rerun this time._", ""]
        lines += [text.rstrip(), SECTION_END, ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", metavar="NAME", help="run only bench/bench_NAME.py")
    parser.add_argument("--quick", action="store_true", help="smoke run: each script with --quick (small N)")
    parser.add_argument("--out", metavar="FILE", type=Path,
                        help=f"where to write (default {DEFAULT_OUT.name}; with --quick, {QUICK_OUT.relative_to(REPO)})")
    args = parser.parse_args(argv)

    available = scripts()
    if args.only:
        name = args.only.removeprefix("bench_").removesuffix(".py")
        if name not in available:
            parser.error(f"no bench/bench_{name}.py (have: {', '.join(available) or 'none'})")
        chosen = {name: available[name]}
    else:
        chosen = available
    if not chosen:
        parser.error("no bench/bench_*.py scripts")
    out: Path = (args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)).resolve()
    if args.quick and out == DEFAULT_OUT.resolve():
        parser.error(f"{DEFAULT_OUT.name} is written from full runs only; give --out another file")

    bench_dir = Path(os.environ.get("ONWARD_BENCH_DIR") or DEFAULT_BENCH_DIR).resolve()
    bench_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc)
    machine = machine_rows(bench_dir)
    env = child_env(bench_dir)
    outcomes = [run_script(name, path, args.quick, env) for name, path in chosen.items()]
    machine.append(("load average at end", f"{load_average()} (1, 5, 15 min)"))
    # A partial run (--only) keeps the other sections of the same report, each marked with its own date.
    kept = kept_sections(out, skip=set(chosen)) if args.only else {}
    kept = {name: v for name, v in kept.items() if name in available}
    text = report(started, machine, args.quick, args.only and next(iter(chosen)), outcomes, kept, available)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    failed = [o.name for o in outcomes if not o.ok]
    print(f"wrote {out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
