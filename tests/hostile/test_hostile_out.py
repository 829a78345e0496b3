"""A hostile ``--out``: things planted in it before a run, and two jobs given the same one.

Whatever was planted (a symlink at a result's name pointing outside, to a file, a folder or nowhere; a
symlinked subfolder; a folder or a FIFO at a result's name; ``--out`` itself a dangling symlink):
- nothing outside ``--out`` is written, created or changed (every file there keeps its bytes);
- the run ends with 0, every result file it could write a regular file with the task's result (a planted
  symlink replaced, never followed), or it refuses in one line with exit 2 and creates no store.
Two jobs on one ``--out`` (two stores, or two jobs of one store): the second is refused in one line with
exit 2 before it writes anything (its store is not created, the first job's files keep their bytes), and
the first job's workers may come back to it as often as they like, however the store's path is spelt.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onward.outdir import OWNER_ATTRIBUTE, file_name
from tests.conftest import run_onward
from tests.hostile.test_hostile_input import EXAMPLES, SETTINGS, assert_one_line_refusal
from tests.reliability import record

TASK_NAMES = st.lists(st.sampled_from(["a", "b", "c", "d", "e", "f", "..", "x/y", "/etc/passwd", "A", "é",
                                       "e\u0301", "sub"]), min_size=1, max_size=6, unique=True)
PLANTS = ["symlink to a file outside", "symlink to a folder outside", "dangling symlink outside",
          "symlinked subfolder", "folder at the name", "fifo at the name"]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="onward-hostile-out-") as d:
        yield Path(d)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``, not following symlinks: a file by its bytes' digest, the rest by kind."""
    seen: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            seen[key] = "symlink -> " + os.readlink(path)
        elif path.is_file():
            seen[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            seen[key] = "folder" if path.is_dir() else "other"
    return seen


def write_tasks(path: Path, names: list[str]) -> None:
    path.write_text("".join(n + "\n" for n in names))


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="needs extended attributes")
def test_whatever_is_planted_in_out_nothing_outside_it_is_written(scratch: Path) -> None:
    tally: Counter[str] = Counter()

    @SETTINGS
    @given(names=TASK_NAMES, plants=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(PLANTS)), max_size=6),
           out_is_dangling=st.booleans())
    def planted(names: list[str], plants: list[tuple[int, str]], out_is_dangling: bool) -> None:
        work = Path(tempfile.mkdtemp(dir=scratch))
        outside = work / "outside"
        (outside / "folder").mkdir(parents=True)
        (outside / "secret").write_bytes(b"not yours\n")
        (outside / "folder" / "kept").write_bytes(b"kept\n")
        tasks = work / "tasks.txt"
        write_tasks(tasks, names)
        out = work / "out"
        if out_is_dangling:
            out.symlink_to(outside / "no-such-folder")
        else:
            out.mkdir()
        planted_at: dict[str, str] = {}
        for index, kind in plants:
            name = file_name(names[index % len(names)])
            if name in planted_at or out_is_dangling:
                continue
            planted_at[name] = kind
            target = out / name
            if kind == "symlink to a file outside":
                target.symlink_to(outside / "secret")
            elif kind == "symlink to a folder outside":
                target.symlink_to(outside / "folder")
            elif kind == "dangling symlink outside":
                target.symlink_to(outside / "created-through-a-symlink")
            elif kind == "symlinked subfolder":
                planted_at.pop(name)
                if not (out / "sub").is_symlink():
                    (out / "sub").symlink_to(outside / "folder", target_is_directory=True)
            elif kind == "folder at the name":
                target.mkdir()
            else:
                os.mkfifo(target)
        before = snapshot(outside)
        db = work / "store" / "onward.db"
        done = run_onward("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "-q", "--",
                          "printf", "%s", "{task}", timeout=60)
        tally["examples"] += 1
        after = snapshot(outside)
        tally["writes_outside_out"] += sum(1 for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        assert after == before, f"written outside --out: {set(before.items()) ^ set(after.items())}"
        assert b"Traceback" not in done.stderr
        if done.returncode == 2:
            tally["refusals"] += 1
            assert_one_line_refusal(done)
            assert not db.parent.exists(), "a refused run must not create a store"
            return
        assert done.returncode == 0, done.stderr
        for task in names:
            path = out / file_name(task)
            if planted_at.get(path.name) == "folder at the name":
                # A folder is never replaced (its contents are not onward's): the result stays in the
                # store, the task done, and the worker says it could not write the file.
                assert path.is_dir() and not path.is_symlink()
                assert "could not write output for task=" in done.stderr.decode(errors="replace")
                tally["folders_left_in_place"] += 1
                continue
            assert path.is_file() and not path.is_symlink(), f"{path.name}: {planted_at.get(path.name)}"
            assert path.read_bytes() == task.encode()
            if path.name in planted_at:
                tally["planted_entries_replaced"] += 1

    planted()
    record("hostile input", backend="-", case="planted symlinks, folders and FIFOs in --out, --out a dangling"
           " symlink", examples=tally["examples"], refusals=tally["refusals"],
           planted_entries_replaced=tally["planted_entries_replaced"],
           folders_left_in_place=tally["folders_left_in_place"], writes_outside_out=tally["writes_outside_out"])
    assert tally["examples"] >= min(EXAMPLES, 1)


def _run(db: Path, tasks: Path, out: Path, *extra: str, mark: str = "") -> subprocess.CompletedProcess[bytes]:
    return run_onward("run", "--db", str(db), *extra, "--tasks", str(tasks), "--out", str(out), "-q", "--",
                      "printf", f"{mark}%s", "{task}", timeout=60)


@pytest.mark.skipif(not hasattr(os, "setxattr"), reason="needs extended attributes")
def test_a_second_job_on_the_same_out_is_refused_and_changes_nothing(scratch: Path) -> None:
    tally: Counter[str] = Counter()

    @SETTINGS
    @given(first=TASK_NAMES, second=TASK_NAMES, same_store=st.booleans())
    def shared(first: list[str], second: list[str], same_store: bool) -> None:
        work = Path(tempfile.mkdtemp(dir=scratch))
        out = work / "out"
        tasks_a, tasks_b = work / "a.txt", work / "b.txt"
        write_tasks(tasks_a, first)
        write_tasks(tasks_b, second)
        db_a = work / "a" / "onward.db"
        assert _run(db_a, tasks_a, out, mark="A:").returncode == 0
        files = snapshot(out)
        if same_store:  # another job of the same store
            store_before = snapshot(db_a.parent)
            refused = _run(db_a, tasks_b, out, "--job", "other", mark="B:")
        else:  # another store
            db_b = work / "b" / "onward.db"
            refused = _run(db_b, tasks_b, out, mark="B:")
        tally["examples"] += 1
        tally["overlapping_names"] += len(set(first) & set(second))
        assert_one_line_refusal(refused)
        assert "holds the results of another job" in refused.stderr.decode()
        tally["refusals"] += 1
        tally["files_replaced"] += sum(1 for k, v in snapshot(out).items() if files.get(k) != v)
        assert snapshot(out) == files, "the refused job changed the first job's files"
        if same_store:
            assert snapshot(db_a.parent) == store_before, "a refused run must not change the store"
        else:
            assert not db_b.parent.exists(), "a refused run must not create a store"
        # The first job may come back, by another spelling of its store's path too.
        again = _run(work / "a" / ".." / "a" / "onward.db", tasks_a, out, mark="A:")
        assert again.returncode == 0, again.stderr
        # Handed over, the folder takes the other job.
        os.removexattr(out, OWNER_ATTRIBUTE)
        handed = _run(db_a, tasks_b, out, "--job", "other", mark="B:") if same_store else _run(
            work / "b" / "onward.db", tasks_b, out, mark="B:")
        assert handed.returncode == 0, handed.stderr
        assert all((out / file_name(n)).read_bytes() == f"B:{n}".encode() for n in second)

    shared()
    record("hostile input", backend="-", case="two jobs sharing one --out (two stores, or two jobs of one"
           " store)", examples=tally["examples"], refusals=tally["refusals"],
           overlapping_task_names=tally["overlapping_names"], files_replaced_by_a_refused_job=tally["files_replaced"])
