"""Hostile input, property-tested with hypothesis against the installed command.

Whatever bytes a tasks file holds, whatever a flag is given, whatever a store file has become:
- the command exits 0, or refuses with exactly one line on stderr and exit 2, never a traceback;
- a refused command changes nothing (no store is created, an existing one keeps every byte);
- an accepted tasks file yields exactly the tasks its lines name (blank and ``#`` lines skipped, one BOM
  at the start ignored, surrounding white space stripped);
- ``onward run --out DIR`` writes nothing outside DIR, one file per task, whatever the tasks are called
  (``..``, ``/``, absolute paths, names equal up to case or Unicode normalisation, control characters).

Each example runs real processes, so the example counts are small here (``ONWARD_HYPOTHESIS_EXAMPLES``
raises them; ``make torture`` uses 300). A failure prints hypothesis's falsifying example and the seed to
replay it with (``--hypothesis-seed``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import run_onward
from tests.reliability import record

EXAMPLES = int(os.environ.get("ONWARD_HYPOTHESIS_EXAMPLES", "8"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Pieces a hostile tasks file is made of: each is a known way to break a line-based reader or a file name.
PIECES = [b"\n", b"\r\n", b"\r", b"\0", b"\xef\xbb\xbf", b"\xff", b"\xc3", b"\xed\xa0\x80", b"..", b"/", b"../",
          b"/etc/passwd", b"#", b" ", b"\t", b"\x1b[31m", b"\x7f", b"\xe2\x80\xa8", b"A", b"a", b"\xc3\xa9",
          b"e\xcc\x81", b"CON", b".onward-tmp-1-ab", b"%", b"{task}", b"$(id)", b"`id`", b"'", b'"', b"\\", b"*"]
TASK_BYTES = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(min_size=1, max_size=8)),
                      min_size=0, max_size=40).map(b"".join)
LONG_LINE = st.integers(min_value=4090, max_value=4200).map(lambda n: b"x" * n + b"\n")


def expected_tasks(data: bytes) -> list[str] | None:
    """The tasks a file with these bytes holds, by the README's rules; None when it must be refused."""
    names: list[str] = []
    lines = data.split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        if len(raw) > 4096:
            return None
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            if not raw.decode("utf-8", "surrogateescape").strip():
                continue
            return None
        if not text:
            continue
        if "\0" in text:
            return None
        if not text.startswith("#") and text not in names:
            names.append(text)
    return names


# What the properties met, per case, counted as they run and recorded for RELIABILITY.md at the end.
TALLIES: dict[str, Counter[str]] = defaultdict(Counter)


@pytest.fixture(scope="module", autouse=True)
def record_tallies() -> Iterator[None]:
    yield
    for case, tally in TALLIES.items():
        record("hostile input", backend="-", case=case, **tally)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="onward-hostile-") as d:
        yield Path(d)


def fresh_dir(scratch: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=scratch))


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def store_names(db: Path) -> list[str]:
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return [name for (name,) in c.execute("SELECT name FROM tasks ORDER BY id")]
    finally:
        c.close()


def assert_one_line_refusal(done: subprocess.CompletedProcess[bytes]) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr)
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: "), done.stderr
    assert b"Traceback" not in done.stderr


@SETTINGS
@given(data=st.one_of(TASK_BYTES, st.tuples(TASK_BYTES, LONG_LINE, TASK_BYTES).map(b"".join)))
def test_any_tasks_file_is_imported_exactly_or_refused_whole(scratch: Path, data: bytes) -> None:
    work = fresh_dir(scratch)
    tasks = work / "tasks.txt"
    tasks.write_bytes(data + b"\n" if data and not data.endswith(b"\n") else data)
    db = work / "store" / "onward.db"
    expected = expected_tasks(tasks.read_bytes())
    done = run_onward("add", "--db", str(db), "--tasks", str(tasks))
    tally = TALLIES["tasks-file bytes (onward add --tasks)"]
    tally["examples"] += 1
    if expected is None:
        tally["refusals"] += 1
        tally["stores_created_by_a_refusal"] += db.parent.exists()
        assert_one_line_refusal(done)
        assert not db.parent.exists(), "a refused tasks file must not create a store"
        return
    assert done.returncode == 0, done.stderr
    names = store_names(db)
    tally["accepted"] += 1
    tally["imported_wrong"] += names != expected
    assert names == expected


@SETTINGS
@given(data=TASK_BYTES)
def test_run_writes_nothing_outside_out_whatever_the_tasks_are_called(scratch: Path, data: bytes) -> None:
    work = fresh_dir(scratch)
    tasks = work / "tasks.txt"
    tasks.write_bytes(data + b"\n")
    expected = expected_tasks(tasks.read_bytes())
    if not expected:
        return  # refusals are the test above; nothing to run
    db, out = work / "store" / "onward.db", work / "out"
    before = tree(work)
    done = run_onward("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "-q", "--",
                      "printf", "%s", "{task}")
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    outside = {p for p in tree(work) - before if not p.startswith(("store", "out"))}
    tally = TALLIES["task names of every kind, run with --out"]
    tally["examples"] += 1
    tally["tasks"] += len(expected)
    tally["writes_outside_out"] += len(outside)
    assert not outside, f"written outside the store and --out: {outside}"
    files = [p for p in out.iterdir()]
    assert all(p.is_file() and not p.is_symlink() for p in files)
    assert len(files) == len(expected), "one file per task, no two tasks sharing one"
    assert sorted(p.read_bytes() for p in files) == sorted(n.encode("utf-8", "surrogateescape") for n in expected)


FLAGS = ["--concurrency", "--max-attempts", "--retry-delay", "--heartbeat", "--timeout", "--grace"]
FLAG_VALUES = st.one_of(
    st.sampled_from(["nan", "NaN", "inf", "-inf", "-1", "0", "1e309", "", " ", "1_000", "0x10", "١", "1e-400",
                     "9" * 40, "\x00", "2", "0.5"]),
    st.text(max_size=6), st.floats().map(repr), st.integers().map(str))


@SETTINGS
@given(flag=st.sampled_from(FLAGS), value=FLAG_VALUES)
def test_any_flag_value_is_taken_or_refused_in_one_line(scratch: Path, flag: str, value: str) -> None:
    if "\x00" in value:
        value = value.replace("\x00", "")  # argv cannot carry a NUL: the kernel stops the string there
    work = fresh_dir(scratch)
    tasks = work / "tasks.txt"
    tasks.write_text("a\n")
    db = work / "store" / "onward.db"
    done = run_onward("run", "--db", str(db), "--tasks", str(tasks), flag, value, "-q", "--", "true")
    tally = TALLIES["flag values (onward run)"]
    tally["examples"] += 1
    if done.returncode == 2:
        tally["refusals"] += 1
        tally["stores_created_by_a_refusal"] += db.parent.exists()
        assert_one_line_refusal(done)
        assert not db.parent.exists(), "a refused flag must not create a store"
    else:
        # 3: the value was taken and the task failed by it (a timeout too short for `true` to finish).
        assert done.returncode in (0, 3), (flag, value, done.stderr)
        assert b"Traceback" not in done.stderr
        assert store_names(db) == ["a"]


@pytest.fixture(scope="module")
def good_store(scratch: Path) -> Path:
    """A real store, with tasks in several states, checkpointed into its main file (an empty -wal). It stays
    in WAL mode, as every onward store is, so that opening it writes nothing to the main file."""
    db = scratch / "good" / "onward.db"
    tasks = scratch / "good-tasks.txt"
    tasks.write_text("".join(f"t{i}\n" for i in range(200)))
    done = run_onward("run", "--db", str(db), "--tasks", str(tasks), "-q", "--max-attempts", "1", "--",
                      "sh", "-c", 'case "$1" in *7) exit 1;; *) echo "$1";; esac', "x", "{task}")
    assert done.returncode == 3, done.stderr  # the tasks ending in 7 failed
    c = sqlite3.connect(db)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    return db


@SETTINGS
@given(cut=st.one_of(st.none(), st.integers(min_value=0, max_value=200_000)),
       flips=st.lists(st.tuples(st.integers(min_value=0, max_value=200_000), st.integers(min_value=1, max_value=255)),
                      max_size=8))
def test_a_damaged_store_is_read_or_refused_in_one_line_and_never_rewritten(
        scratch: Path, good_store: Path, cut: int | None, flips: list[tuple[int, int]]) -> None:
    data = bytearray(good_store.read_bytes())
    if cut is not None:
        del data[cut % (len(data) + 1):]
    for at, mask in flips:
        if data:
            data[at % len(data)] ^= mask
    work = fresh_dir(scratch)
    db = work / "onward.db"
    db.write_bytes(bytes(data))
    tally = TALLIES["truncated or bit-flipped store files (status, list, retry)"]
    tally["examples"] += 1
    for command in (["status"], ["list"], ["retry", "--failed"]):
        digest = hashlib.sha256(db.read_bytes()).hexdigest()
        done = run_onward(*command, "--db", str(db))
        tally["commands"] += 1
        assert b"Traceback" not in done.stderr, (command, done.stderr)
        if done.returncode != 0:
            tally["refusals"] += 1
            changed = not db.exists() or hashlib.sha256(db.read_bytes()).hexdigest() != digest
            tally["stores_changed_by_a_refusal"] += changed
            assert done.returncode == 2, (command, done.returncode, done.stderr)
            assert_one_line_refusal(done)
            assert not changed, f"{command}: a refused store must keep every byte"
    shutil.rmtree(work)
