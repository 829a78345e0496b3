"""onward.outdir: result file names and atomic, symlink-proof writes, on real files in tmp_path."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote_to_bytes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from onward.errors import UsageError
from onward.outdir import TEMP_PREFIX, OutDir, _create_new_file, file_name

HOSTILE_TASKS = [
    "..",
    ".",
    "",
    "/",
    "/etc/passwd",
    "a/../../x",
    "../../../../tmp/escaped",
    ".a",
    ".onward-tmp-1-00",
    "~",
    "~a",
    "%2E%2E",
    "a\\b",
    "tab\there",
    "\x01\x7f",
    "é",
    "日本語/タスク",
    "\udcff",  # a lone surrogate, as os.fsdecode gives for an undecodable byte
    "x" * 201,
    "." * 4096,
    "/" * 4096,
    "é" * 2048,
]


def temp_files(folder: Path) -> list[str]:
    return [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)]


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (reuse within the test is out of reach)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- file names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["build", "build-1.2_x", "a.b", "A", "0", "-rf", "_", "x" * 200, "a..b"])
def test_safe_names_are_kept_as_they_are(task: str) -> None:
    assert file_name(task) == task + ".txt"


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ("..", "~%2E%2E.txt"),
        (".", "~%2E.txt"),
        ("", "~.txt"),
        ("/etc/passwd", "~%2Fetc%2Fpasswd.txt"),
        ("a/../../x", "~a%2F%2E%2E%2F%2E%2E%2Fx.txt"),
        (".a", "~%2Ea.txt"),
        (".onward-tmp-1-00", "~%2Eonward-tmp-1-00.txt"),
        ("a b", "~a%20b.txt"),
        ("~", "~%7E.txt"),
        ("50%", "~50%25.txt"),
        ("é", "~%C3%A9.txt"),
        ("\udcff", "~%ED%B3%BF.txt"),
    ],
)
def test_other_names_are_escaped(task: str, expected: str) -> None:
    assert file_name(task) == expected


def test_a_name_just_over_the_limit_is_hashed() -> None:
    assert file_name("x" * 201) == "~" + "x" * 128 + "~" + hashlib.sha256(b"x" * 201).hexdigest() + ".txt"


def test_an_escaped_name_is_hashed_only_past_200_bytes() -> None:
    assert file_name("~" * 66 + "a") == "~" + "%7E" * 66 + "a.txt"  # a stem of exactly 200 bytes
    # One byte more: hashed, keeping the 42 whole escapes (126 bytes) that fit in the 128-byte prefix.
    digest = hashlib.sha256(b"~" * 66 + b"ab").hexdigest()
    assert file_name("~" * 66 + "ab") == "~" + "%7E" * 42 + "~" + digest + ".txt"


def test_a_4_kib_name_keeps_a_readable_prefix_and_the_full_hash() -> None:
    task = "report for " + "é" * 2043  # 4097 bytes of UTF-8
    name = file_name(task)
    prefix, digest = name.removesuffix(".txt").removeprefix("~").split("~")
    assert prefix.startswith("report%20for%20%C3%A9")
    assert len(prefix) <= 128
    assert re.fullmatch("report%20for(%20)?(%C3%A9)*", prefix)  # whole escapes only, none cut apart
    assert digest == hashlib.sha256(task.encode()).hexdigest()
    assert len(name.encode()) <= 255


def assert_one_path_component(name: str) -> None:
    assert "/" not in name and "\0" not in name
    assert name not in (".", "..")
    assert not name.startswith(".")  # never hidden, never a temp file's name
    assert len(name.encode("utf-8", "surrogatepass")) <= 255


def decoded_task(name: str) -> str | None:
    """The task text a short name stands for, or None for a hashed name (which keeps only a prefix)."""
    stem = name.removesuffix(".txt")
    if not stem.startswith("~"):
        return stem
    if "~" in stem[1:]:
        return None
    return unquote_to_bytes(stem[1:]).decode("utf-8", "surrogatepass")


# Texts that crowd the escaping rules: the characters they treat specially, short and long enough to be
# hashed, and any Unicode at all (lone surrogates included).
TRICKY_ALPHABET = "a.~%-_/2E é\0\udcff"
texts = st.one_of(
    st.text(alphabet=TRICKY_ALPHABET, max_size=80),
    st.text(alphabet=TRICKY_ALPHABET, min_size=60, max_size=300),
    st.text(st.characters(exclude_categories=()), max_size=300),
)


@given(st.lists(texts, min_size=1, max_size=40))
def test_distinct_texts_get_distinct_single_component_names(drawn: list[str]) -> None:
    # Tasks named after other tasks' file names (with and without '.txt') are the likeliest to collide.
    tasks = sorted({*drawn, *(file_name(task) for task in drawn), *(file_name(task)[:-4] for task in drawn)})
    names = [file_name(task) for task in tasks]
    assert len(set(names)) == len(tasks)
    for task, name in zip(tasks, names, strict=True):
        assert_one_path_component(name)
        task_back = decoded_task(name)
        if task_back is None:
            digest = hashlib.sha256(task.encode("utf-8", "surrogatepass")).hexdigest()
            assert name == name[: -len(digest) - 4] + digest + ".txt"
        else:
            assert task_back == task


# --- writing ------------------------------------------------------------------------------------------


def test_write_then_has_and_read_back(tmp_path: Path) -> None:
    with OutDir(str(tmp_path / "out")) as out:
        assert not out.has("a/b")
        out.write("a/b", b"result")
        assert out.has("a/b")
        out.write("a/b", b"second")
    assert (tmp_path / "out" / file_name("a/b")).read_bytes() == b"second"


def test_result_files_have_mode_0600(tmp_path: Path) -> None:
    with OutDir(str(tmp_path)) as out:
        out.write("t", b"x")
    assert stat.S_IMODE((tmp_path / "t.txt").stat().st_mode) == 0o600


def test_writes_never_land_outside_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "out"
    with OutDir(str(folder)) as out:
        for task in HOSTILE_TASKS:
            out.write(task, task.encode("utf-8", "surrogatepass"))
    everything = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*"))
    assert everything == sorted(["out"] + [f"out/{file_name(task)}" for task in HOSTILE_TASKS])
    for task in HOSTILE_TASKS:
        assert (folder / file_name(task)).read_bytes() == task.encode("utf-8", "surrogatepass")


def test_a_symlink_at_the_result_name_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "t.txt").symlink_to(outside)
    with OutDir(str(folder)) as out:
        assert not out.has("t")  # a symlink is not a result
        out.write("t", b"result")
        assert out.has("t")
    assert not (folder / "t.txt").is_symlink()
    assert (folder / "t.txt").read_bytes() == b"result"
    assert outside.read_bytes() == b"precious"


def test_a_symlink_at_a_temp_name_is_never_opened(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    folder = tmp_path / "out"
    folder.mkdir()
    planted = f"{TEMP_PREFIX}{os.getpid()}-0123456789abcdef"
    (folder / planted).symlink_to(outside)
    (folder / (planted + "0")).symlink_to(tmp_path / "missing")  # dangling: O_CREAT alone would create it
    dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in (planted, planted + "0"):
            with pytest.raises(FileExistsError):
                _create_new_file(dir_fd, name)
    finally:
        os.close(dir_fd)
    assert outside.read_bytes() == b"precious"
    assert not (tmp_path / "missing").exists()


def test_has_counts_only_regular_files(tmp_path: Path) -> None:
    (tmp_path / "d.txt").mkdir()
    with OutDir(str(tmp_path)) as out:
        assert not out.has("d")
        assert not out.has("never written")


def test_a_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "d.txt").mkdir()  # rename cannot replace a folder with a file
    with OutDir(str(tmp_path)) as out:
        with pytest.raises(IsADirectoryError):
            out.write("d", b"x")
    assert temp_files(tmp_path) == []


def test_readers_see_the_old_or_the_new_file_never_a_partial_one(tmp_path: Path) -> None:
    old, new = b"o" * (1 << 20), b"n" * (1 << 20)
    seen: set[bytes] = set()
    with OutDir(str(tmp_path)) as out:
        out.write("t", old)
        done = threading.Event()

        def read_until_done() -> None:
            while not done.is_set():
                seen.add((tmp_path / "t.txt").read_bytes())

        reader = threading.Thread(target=read_until_done)
        reader.start()
        try:
            for round_number in range(20):
                out.write("t", new if round_number % 2 == 0 else old)
        finally:
            done.set()
            reader.join()
    assert seen <= {old, new}
    assert temp_files(tmp_path) == []


def test_use_after_close_is_refused(tmp_path: Path) -> None:
    out = OutDir(str(tmp_path))
    out.close()
    out.close()
    with pytest.raises(ValueError, match="closed"):
        out.write("t", b"x")
    with pytest.raises(ValueError, match="closed"):
        out.has("t")


# --- opening ------------------------------------------------------------------------------------------


def test_missing_folders_are_created_with_mode_0700(tmp_path: Path) -> None:
    old_umask = os.umask(0o022)
    try:
        OutDir(str(tmp_path / "a" / "b" / "c")).close()
    finally:
        os.umask(old_umask)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert os.listdir(tmp_path / "a" / "b" / "c") == []  # the probe file is gone


def test_an_existing_folder_keeps_its_mode(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    OutDir(str(tmp_path)).close()
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755


def test_the_folder_may_be_reached_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with OutDir(str(tmp_path / "link")) as out:
        out.write("t", b"x")
    assert (tmp_path / "real" / "t.txt").read_bytes() == b"x"


def test_stale_temp_files_of_dead_writers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = f"{TEMP_PREFIX}{dead_pid()}-00ff"
        kept = [
            f"{TEMP_PREFIX}{os.getpid()}-00ff",
            f"{TEMP_PREFIX}{sleeper.pid}-00ff",
            f"{TEMP_PREFIX}0-00ff",  # pid 0 would mean our own process group to os.kill
            f"{TEMP_PREFIX}-1-00ff",
            f"{TEMP_PREFIX}x-00ff",
            "results.txt",
        ]
        for name in [dead, *kept]:
            (tmp_path / name).write_bytes(b"partial")
        with OutDir(str(tmp_path)) as out:
            for _ in out.remove_stale_temp_files():
                pass
        assert sorted(os.listdir(tmp_path)) == sorted(kept)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_temp_file_whose_writer_pid_was_reused_is_removed(tmp_path: Path) -> None:
    """A temp file's name carries its writer's start time beside its pid: a live process that got a dead
    writer's pid (pids are reused: 32,768 by default) does not keep the dead writer's file. The power-cut
    test's final check found such a file left under load."""
    from onward.outdir import _new_temp_name
    from onward.proc import pid_start_time

    own = _new_temp_name()
    start = pid_start_time(os.getpid())
    assert start is not None
    assert own.startswith(f"{TEMP_PREFIX}{os.getpid()}-{start}-")
    reused = f"{TEMP_PREFIX}{os.getpid()}-{start + 1}-00ff"  # our pid, another process's start: gone
    kept = [f"{TEMP_PREFIX}{os.getpid()}-{start}-00ff", f"{TEMP_PREFIX}{os.getpid()}-00ff"]
    for name in [reused, *kept]:
        (tmp_path / name).write_bytes(b"partial")
    with OutDir(str(tmp_path)) as out:
        for _ in out.remove_stale_temp_files():
            pass
        out.write("t", b"x")  # and its own temp file, named the new way, is renamed into place
    assert sorted(os.listdir(tmp_path)) == sorted([*kept, "t.txt"])


def test_a_folder_under_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(UsageError) as error:
        OutDir(str(tmp_path / "afile" / "sub"))
    assert (
        str(error.value)
        == f"cannot write to output folder {str(tmp_path / 'afile' / 'sub')!r}: Not a directory"
    )


def test_a_file_given_as_the_folder_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    with pytest.raises(UsageError, match="Not a directory"):
        OutDir(str(tmp_path / "afile"))


@contextmanager
def as_nobody() -> Iterator[None]:
    """Drop root's effective uid for a moment, since root may write anywhere the mode bits forbid."""
    if os.geteuid() != 0:
        yield
        return
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)


def test_a_folder_that_cannot_be_written_is_a_usage_error() -> None:
    # Not under tmp_path: its parents are 0o700 root's, so nobody could not even reach it.
    folder = tempfile.mkdtemp()
    os.chmod(folder, 0o555)  # readable and searchable, not writable: only the probe file can fail
    try:
        with as_nobody(), pytest.raises(UsageError) as error:
            OutDir(folder)
        assert str(error.value) == f"cannot write to output folder {folder!r}: Permission denied"
        assert os.listdir(folder) == []
    finally:
        os.rmdir(folder)
