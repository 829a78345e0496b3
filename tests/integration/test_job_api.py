"""The Python API (`Job`), in-process and as a worker process killed and stopped with real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from onward import Job, TaskContext, TaskNotDone, UsageError
from onward.log import QUIET
from tests.conftest import process_state, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_results_of_every_kind_round_trip(store_url: str) -> None:
    job = Job(store_url, log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> object:
        return {"text": task, "bytes": task.encode(), "json": {"n": len(task), "ok": True}}[task]

    assert job.add(["text", "bytes", "json"]) == 3
    assert job.add(["text"]) == 0
    summary = job.run()
    assert (summary.done, summary.failed, summary.exit_code) == (3, 0, 0)
    assert job.result("text") == "text"
    assert job.result("bytes") == b"bytes"
    assert job.result("json") == {"n": 4, "ok": True}
    job.close()


@pytest.mark.parametrize(("value", "says"), [
    ({1: "a", "1": "b"}, "the object key 1 is not a string"),  # was stored as {"1": "a", "1": "b"}: "a" lost
    ([{"k": {None: 1}}], "the object key None is not a string"),  # was {"null": 1}
    (json.loads("[" * 250 + "]" * 250), "nested deeper than 200 levels"),  # 985 levels: done, never read back
])
def test_a_result_json_would_change_or_not_read_back_fails_the_task_clearly(tmp_path: Path, value: object,
                                                                           says: str) -> None:
    """A result is stored as the function returned it, or not at all: JSON turns a key that is not a string
    into one (two keys may then collide, one value lost), and a value nested deeper than the decoder's
    stack takes could be stored but never read back. Both fail the attempt, naming why."""
    job = Job(str(tmp_path / "s.db"), log_level=QUIET, max_attempts=1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> object:
        return value

    job.add(["t"])
    summary = job.run()
    assert (summary.done, summary.failed) == (0, 1)
    row = job.store.task("t")
    assert row is not None and row.state == "failed"
    assert "not str, bytes or a JSON value" in (row.error or "") and says in (row.error or ""), row.error
    job.close()


def test_a_result_holding_a_lone_surrogate_is_stored_and_read_back_equal(tmp_path: Path) -> None:
    """A model's answer cut inside an emoji ends in a lone surrogate, which UTF-8 cannot hold. Returned as a
    task's result (a str, or inside a JSON value) it failed every attempt with a UnicodeEncodeError
    traceback from onward's own code; it is stored as JSON with its escape, as a step's value is, and
    read back equal. A surrogate pair written as two characters cannot be, and fails naming why."""
    cut = "the answer is \ud83d"
    values = {"str": cut, "json": {"text": cut, "n": 1}, "pair": "\ud83d\ude00"}
    job = Job(str(tmp_path / "s.db"), log_level=QUIET, max_attempts=1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> object:
        return values[task]

    job.add(list(values))
    summary = job.run()
    assert (summary.done, summary.failed) == (2, 1)
    assert job.result("str") == cut
    assert job.result("json") == {"text": cut, "n": 1}
    row = job.store.task("pair")
    assert row is not None and row.state == "failed"
    assert "surrogate pair as two characters" in (row.error or ""), row.error
    assert "UnicodeEncodeError" not in (row.error or ""), row.error
    job.close()
    r = run_onward("result", "--db", str(tmp_path / "s.db"), "str")  # a JSON result, printed as JSON
    assert (r.returncode, r.stdout) == (0, b'"the answer is \\ud83d"'), (r.returncode, r.stdout, r.stderr)



def test_a_note_that_is_not_valid_unicode_does_not_bring_the_worker_down(tmp_path: Path) -> None:
    """``ctx.beat(note)`` with a lone surrogate (text decoded from bytes with surrogateescape): the lease
    renewal that carries the note failed to encode it, and the worker died, its tasks left running until
    their leases ran out. The note is kept escaped instead, and the task finishes."""
    job = Job(str(tmp_path / "s.db"), log_level=QUIET, heartbeat=0.1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> object:
        ctx.beat("read \udcff of the file")
        import time

        time.sleep(0.5)  # a few renewals carry the note
        return "ok"

    job.add(["t"])
    summary = job.run()
    assert (summary.done, summary.failed) == (1, 0)
    assert job.result("t") == "ok"
    job.close()


def test_cli_prints_results_as_documented(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    job = Job(db, log_level=QUIET)
    job.task(lambda task, ctx: {"s": "héllo", "b": b"\x00\xff", "j": [1, "two"]}[task])
    job.add(["s", "b", "j"])
    job.run()
    job.close()
    assert run_onward("result", "--db", db, "s").stdout == "héllo".encode()
    assert run_onward("result", "--db", db, "b").stdout == b"\x00\xff"
    assert json.loads(run_onward("result", "--db", db, "j").stdout) == [1, "two"]


def test_resume_does_not_redo_done_tasks(store_url: str) -> None:
    calls: list[str] = []
    job = Job(store_url, log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        calls.append(task)
        return task.upper()

    job.add(["a", "b"])
    job.run()
    job.add(["b", "c"])
    job.run()
    assert calls == ["a", "b", "c"]
    job.close()


def test_exceptions_are_retried_then_fail(store_url: str) -> None:
    attempts: list[int] = []
    job = Job(store_url, log_level=QUIET, retry_delay=0.01)

    @job.task(max_attempts=3)
    def handle(task: str, ctx: TaskContext) -> str:
        attempts.append(ctx.attempt)
        if task == "flaky" and ctx.attempt < 2:
            raise ConnectionError("try again")
        if task == "broken":
            raise ValueError("always broken")
        return "ok"

    job.add(["flaky", "broken", "fine"])
    summary = job.run()
    assert (summary.done, summary.failed, summary.exit_code) == (2, 1, 3)
    assert job.result("flaky") == "ok"
    with pytest.raises(TaskNotDone):
        job.result("broken")
    row = job.store.task("broken")
    assert row is not None and row.attempts == 3 and "ValueError: always broken" in (row.error or "")
    job.close()


def test_timeout_cancels_a_python_task_that_checks(store_url: str) -> None:
    job = Job(store_url, log_level=QUIET, timeout=0.2, max_attempts=1)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        while True:
            ctx.check()
            ctx.beat("spinning")
            import time
            time.sleep(0.01)

    job.add(["spin"])
    summary = job.run()
    assert summary.failed == 1
    row = job.store.task("spin")
    assert row is not None and "timed out after 0.2s" in (row.error or "")
    job.close()


def test_bad_values_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        Job(str(tmp_path / "s.db"), concurrency=0)
    job = Job(str(tmp_path / "s.db"))
    with pytest.raises(UsageError):
        job.add([""])
    with pytest.raises(UsageError):
        job.add(["x" * 5000])
    with pytest.raises(UsageError, match="no task function"):
        job.run()
    job.close()


WORKER = textwrap.dedent("""
    import os, sys, time
    from onward import Job
    job = Job(sys.argv[1], heartbeat=0.2, grace=float(sys.argv[3]))
    marks = sys.argv[2]

    @job.task
    def handle(task, ctx):
        with open(marks, "a") as f:
            f.write(f"start {task} {ctx.attempt} {os.getpid()}\\n")
        if task == "slow":
            while not ctx.stopping:
                time.sleep(0.01)
            with open(marks, "a") as f:
                f.write(f"saw-stop {task}\\n")
            return "stopped early but finished"
        if task == "ignore":
            while True:
                time.sleep(0.01)
        return task

    job.add(sys.argv[4:])
    sys.exit(job.run().exit_code)
""")


def start_worker(tmp_path: Path, db: str, grace: float, *tasks: str) -> subprocess.Popen[bytes]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return subprocess.Popen([sys.executable, str(script), db, str(tmp_path / "marks"), str(grace), *tasks],
                            env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def marks(tmp_path: Path) -> list[str]:
    path = tmp_path / "marks"
    return path.read_text().splitlines() if path.exists() else []


def test_sigterm_sets_the_stop_flag_and_the_task_finishes(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    p = start_worker(tmp_path, db, 10, "slow", "other")
    wait_for(lambda: any(m.startswith("start slow") for m in marks(tmp_path)), 20, "the slow task to start")
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    assert "saw-stop slow" in marks(tmp_path)
    job = Job(db)
    assert job.result("slow") == "stopped early but finished"
    assert job.store.task("other").state == "pending"  # type: ignore[union-attr]
    job.close()


@pytest.mark.parametrize("phase", ["claim_committed", "attempt_started"])
def test_a_sigterm_while_a_task_is_being_started_still_reaches_it(tmp_path: Path, phase: str) -> None:
    """The SIGTERM handler tells the attempts it finds to stop. One came (once, on a loaded machine) after the
    slow task was claimed and before its attempt was counted among them: the task never saw ``ctx.stopping``
    and the worker waited out its whole grace. Here the worker freezes itself at that moment (SIGSTOP), gets
    its SIGTERM while frozen, and goes on (SIGCONT). Claimed but not yet started: given back uncounted, never
    started. Started (its thread may be running it): told to stop like any running task."""
    db = str(tmp_path / "s.db")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    p = subprocess.Popen([sys.executable, str(script), db, str(tmp_path / "marks"), "15", "slow", "other"],
                         env=dict(os.environ, PYTHONPATH=SRC, ONWARD_TEST_HOOKS="1", ONWARD_FREEZE_AT=f"{phase}:1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: process_state(p.pid) == "T", 30, "the worker to freeze itself")
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
        _, err = p.communicate(timeout=60)  # a task left unaware runs until the grace (15 s) is out
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err.decode()
    job = Job(db)
    if phase == "claim_committed":
        assert not any(m.startswith("start slow") for m in marks(tmp_path)), marks(tmp_path)
        assert "stopped by SIGTERM before it started" in err.decode(), err.decode()[-2000:]
        slow = job.store.task("slow")
        assert slow is not None and (slow.state, slow.attempts) == ("pending", 0), slow  # given back uncounted
    else:
        assert "saw-stop slow" in marks(tmp_path), err.decode()[-2000:]
        assert job.result("slow") == "stopped early but finished"
    assert job.store.task("other").state == "pending"  # type: ignore[union-attr]
    job.close()


def test_a_killed_python_worker_reruns_its_task_with_the_next_attempt(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    p = start_worker(tmp_path, db, 10, "slow")
    wait_for(lambda: any(m.startswith("start slow 1") for m in marks(tmp_path)), 20, "attempt 1 to start")
    p.kill()
    p.wait()
    p = start_worker(tmp_path, db, 10, "slow")
    wait_for(lambda: any(m.startswith("start slow 2") for m in marks(tmp_path)), 20, "attempt 2 to start")
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=20)
    assert p.returncode == 0


def test_a_task_ignoring_cancellation_makes_the_worker_exit_for_a_restart(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    script = tmp_path / "w.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from onward import Job
        job = Job({db!r}, timeout=0.3, grace=0.3, max_attempts=2)
        @job.task
        def handle(task, ctx):
            while True:
                time.sleep(0.01)   # never checks ctx: cannot be cancelled
        job.add(["stuck"])
        job.run()
    """))
    p = subprocess.run([sys.executable, str(script)],
                       env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=60)
    assert p.returncode != 0
    assert b"ignored cancellation" in p.stderr
    job = Job(db)
    row = job.store.task("stuck")
    assert row is not None and row.attempts == 1
    job.close()


def test_a_bad_name_anywhere_adds_nothing(store_url: str) -> None:
    job = Job(store_url, log_level=QUIET)
    names = (f"t{i}" if i != 5000 else "" for i in range(10_000))
    with pytest.raises(UsageError, match="cannot be empty"):
        job.add(names)
    assert job.store.counts()["pending"] == 0
    job.close()


@pytest.mark.parametrize("tasks, message", [
    ("report-2024", "a single str"),
    (b"report", "bytes"),
    ([b"xy"], "bytes"),
    (["ok", None], "NoneType"),
    (["ok", 7], "int"),
])
def test_add_refuses_a_bare_string_bytes_and_non_str_items(tmp_path: Path, tasks: object, message: str) -> None:
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    with pytest.raises(TypeError, match=message):
        job.add(tasks)  # type: ignore[arg-type]
    assert job.store.counts().get("pending", 0) == 0
    job.close()


def test_add_refuses_a_name_that_is_not_utf8(tmp_path: Path) -> None:
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    with pytest.raises(UsageError, match="valid UTF-8"):
        job.add(["fine", "bad\udcff"])
    assert job.store.counts().get("pending", 0) == 0
    job.close()


def test_run_refuses_a_keep_awake_path_that_is_a_directory_before_running(tmp_path: Path) -> None:
    job = Job(str(tmp_path / "s.db"), keep_awake=str(tmp_path), log_level=QUIET)
    ran: list[str] = []

    @job.task
    def handle(task: str, ctx: object) -> str:
        ran.append(task)
        return task

    job.add(["a"])
    with pytest.raises(UsageError, match="keep-awake marker .* is a directory"):
        job.run()
    assert ran == [] and job.store.counts()["pending"] == 1
    job.close()


def test_a_python_worker_its_task_kills_leaves_no_keep_awake_marker(tmp_path: Path) -> None:
    """The OOM killer takes a Python worker for what its task holds (its memory is the worker's): with no
    supervisor, the marker keeper the worker started removes the marker it can no longer remove itself."""
    marker = tmp_path / "keep-awake"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal
        from onward import Job
        from onward.log import QUIET
        job = Job({str(tmp_path / "s.db")!r}, keep_awake={str(marker)!r}, log_level=QUIET)

        @job.task
        def handle(task, ctx):
            os.kill(os.getpid(), signal.SIGKILL)

        job.add(["big"])
        job.run()
    """))
    lone = dict(os.environ, PYTHONPATH=SRC)
    lone.pop("NOTIFY_SOCKET", None)
    r = subprocess.run([sys.executable, str(script)], env=lone, capture_output=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    wait_for(lambda: not marker.exists(), 20, "the killed worker's marker to be removed")
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    assert job.store.counts()["running"] == 1  # the task itself is left for the next worker to reclaim
    job.close()


def test_a_forked_worker_its_task_kills_leaves_no_keep_awake_marker_while_its_parent_lives(tmp_path: Path) -> None:
    """The same in a child forked (multiprocessing) from a process that ran a job with that marker before: the
    child has a keeper of its own. (The parent's, inherited, watches a pipe the parent holds open as well.)"""
    marker = tmp_path / "keep-awake"
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, os, signal, sys, time
        from onward import Job
        from onward.log import QUIET

        def job(name):
            return Job({str(tmp_path / "s.db")!r}, name=name, keep_awake={str(marker)!r}, log_level=QUIET)

        def child():
            worker = job("child")

            @worker.task
            def handle(task, ctx):
                os.kill(os.getpid(), signal.SIGKILL)

            worker.add(["big"])
            worker.run()

        if __name__ == "__main__":
            first = job("first")

            @first.task
            def quick(task, ctx):
                return task

            first.add(["a"])
            assert first.run().done == 1 and not os.path.exists({str(marker)!r})
            process = multiprocessing.get_context("fork").Process(target=child)
            process.start()
            process.join(60)
            deadline = time.monotonic() + 20
            while os.path.exists({str(marker)!r}) and time.monotonic() < deadline:
                time.sleep(0.02)
            print(process.exitcode, "stayed" if os.path.exists({str(marker)!r}) else "removed")
    """))
    lone = dict(os.environ, PYTHONPATH=SRC)
    lone.pop("NOTIFY_SOCKET", None)
    r = subprocess.run([sys.executable, str(script)], env=lone, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(-signal.SIGKILL), "removed"], r.stdout + r.stderr


def test_an_error_text_with_nul_bytes_fails_its_task_on_every_backend_and_stalls_nothing(
        store_url: str, tmp_path: Path) -> None:
    """A command whose stderr holds a NUL byte, beside others that succeed, at concurrency 4: PostgreSQL's
    text cannot hold NUL, so the commit of the whole batch failed again and again (the job stalled, the
    other tasks' completions with it). The error is kept with the NUL escaped, as on SQLite."""
    names = [f"t{i}" for i in range(12)]
    script = ("import sys\n"
              "if sys.argv[1] == 't3':\n"
              "    sys.stderr.write('bad\\x00byte\\n'); sys.exit(1)\n"
              "print('ok')\n")
    r = run_onward("run", "--db", store_url, "--concurrency", "4", "--max-attempts", "1", "--tasks", "-", "--",
                   sys.executable, "-c", script, "{task}", input="".join(n + "\n" for n in names).encode(),
                   timeout=120)
    assert r.returncode == 3, r.stderr.decode(errors="replace")[-2000:]
    assert b"store error" not in r.stderr, r.stderr.decode(errors="replace")[-2000:]
    job = Job(store_url, log_level=QUIET)
    row = job.store.task("t3")
    assert row is not None and row.state == "failed" and "bad\\x00byte" in (row.error or ""), row
    assert job.store.counts()["done"] == len(names) - 1
    job.close()


@pytest.mark.parametrize("concurrency", [1, 3])
def test_an_error_text_with_a_lone_surrogate_fails_its_task_and_the_worker_goes_on(
        store_url: str, concurrency: int) -> None:
    """An exception whose message holds a lone surrogate (half an emoji in a model's cut answer): neither store
    can hold it as it is, and the commit of the failure raised UnicodeEncodeError out of ``job.run()``; each
    run then reclaimed the task and died again, and it ended failed as "owner died", its own error never
    recorded. Now the error is kept escaped, as a NUL is, and the tasks beside it finish."""
    job = Job(store_url, max_attempts=2, retry_delay=0.01, concurrency=concurrency, log_level=QUIET)

    @job.task
    def answer(task: str, ctx: TaskContext) -> str:
        if task == "cut":
            raise ValueError("model said: \udcff")
        return task

    job.add(["a", "cut", "b", "c"])
    summary = job.run()
    assert (summary.done, summary.failed, summary.exit_code) == (3, 1, 3)
    row = job.store.task("cut")
    assert row is not None and row.state == "failed" and row.attempts == 2, row
    assert "ValueError: model said: \\udcff" in (row.error or ""), row.error
    job.close()


@pytest.mark.parametrize(("setting", "value"), [("concurrency", 2.5), ("concurrency", True), ("max_attempts", 2.5),
                                                 ("max_attempts", "3")])
def test_a_count_that_is_not_a_whole_number_is_refused(tmp_path: Path, setting: str, value: object) -> None:
    """``Job(concurrency=2.5)`` was taken, and then every claim failed ("datatype mismatch") for ever."""
    with pytest.raises(UsageError, match="must be a whole number"):
        Job(str(tmp_path / "s.db"), **{setting: value})  # type: ignore[arg-type]  # wrong on purpose
    assert not (tmp_path / "s.db").exists()


# Each setting of Job(...) given a value of the wrong type, and what it takes. (A count's float and a
# concurrency of True are in test_a_count_that_is_not_a_whole_number_is_refused above.)
JOB_WRONG_TYPES: list[tuple[str, object]] = [
    ("db", 5), ("db", b"s.db"),
    ("name", 5), ("name", b"nightly"),
    ("concurrency", "4"), ("concurrency", None),
    ("max_attempts", None), ("max_attempts", True),
    ("retry_delay", "1"), ("retry_delay", None), ("retry_delay", True),
    ("timeout", "600"), ("timeout", True),
    ("heartbeat", None), ("heartbeat", True), ("heartbeat", "5"),
    ("grace", None), ("grace", [10]),
    ("stall_timeout", "60"), ("stall_timeout", False),
    ("park_sleeps_over", None), ("park_sleeps_over", "60"),
    ("out", 3), ("out", b"results"),
    ("keep_awake", 5), ("keep_awake", True), ("keep_awake", b"marker"),
    ("log_level", "verbose"), ("log_level", None), ("log_level", True), ("log_level", 1.0), ("log_level", 7),
]
# The settings only RunConfig has (Job.run(**overrides) takes them, as it takes every RunConfig field).
RUN_ONLY_WRONG_TYPES: list[tuple[str, object]] = [
    ("max_retry_delay", "300"), ("max_retry_delay", None),
    ("lease", "30"), ("lease", True),
    ("install_signal_handlers", "no"), ("install_signal_handlers", 1), ("install_signal_handlers", None),
]


def assert_refuses_the_type(message: str, setting: str, value: object) -> None:
    """One line that names the setting, says what it takes, and what it got instead."""
    assert "\n" not in message, message
    assert message.startswith(f"{setting} must be "), message
    assert f", not {type(value).__name__}: " in message, message


def test_the_wrong_type_cases_cover_every_setting_of_job_and_runconfig() -> None:
    """A setting added later without a case here fails this, rather than going unchecked."""
    import dataclasses
    import inspect

    from onward.config import RunConfig

    settings = {*inspect.signature(Job).parameters, *(f.name for f in dataclasses.fields(RunConfig))}
    assert settings == {setting for setting, _ in JOB_WRONG_TYPES + RUN_ONLY_WRONG_TYPES}


@pytest.mark.parametrize(("setting", "value"), JOB_WRONG_TYPES)
def test_a_job_setting_of_the_wrong_type_is_refused_naming_it_and_creating_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, value: object) -> None:
    """A TypeError or AttributeError from deep inside (``heartbeat=None``, ``db=5``), or the value taken and
    a store created (``keep_awake=5``, ``log_level="x"``, ``heartbeat=True``), before; now UsageError."""
    monkeypatch.chdir(tmp_path)  # the default store, .onward/onward.db, would be made here
    settings = {"db": str(tmp_path / "s.db"), setting: value}
    with pytest.raises(UsageError) as refused:
        Job(**settings)  # type: ignore[arg-type]  # wrong on purpose
    assert_refuses_the_type(str(refused.value), setting, value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("setting", "value"), RUN_ONLY_WRONG_TYPES)
def test_a_run_setting_of_the_wrong_type_is_refused_before_any_task_runs(
        tmp_path: Path, setting: str, value: object) -> None:
    from onward.config import RunConfig

    with pytest.raises(UsageError) as refused:
        RunConfig(**{setting: value})  # type: ignore[arg-type]  # wrong on purpose
    assert_refuses_the_type(str(refused.value), setting, value)
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    ran: list[str] = []
    job.task(ran.append)
    job.add(["a"])
    with pytest.raises(UsageError) as refused:
        job.run(**{setting: value})
    assert_refuses_the_type(str(refused.value), setting, value)
    assert ran == [] and job.store.counts()["pending"] == 1
    job.close()


def test_a_misspelt_run_setting_is_refused_in_one_line_before_any_task_runs(tmp_path: Path) -> None:
    """``job.run(concurency=4)`` raised dataclasses' TypeError about ``RunConfig.__init__``; it is a usage
    error naming the setting and what run() takes, and nothing runs."""
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    ran: list[str] = []
    job.task(ran.append)
    job.add(["a"])
    with pytest.raises(UsageError, match=r"run\(\) has no setting 'concurency'; it takes concurrency, "):
        job.run(concurency=4)
    assert ran == [] and job.store.counts()["pending"] == 1
    job.close()


@pytest.mark.parametrize(("value", "says"), [(float("nan"), "max retry delay must be a finite number of seconds"),
                                             (-1.0, "max retry delay cannot be negative")])
def test_a_max_retry_delay_that_is_not_a_finite_number_of_seconds_is_refused(value: float, says: str) -> None:
    """The one duration that was not checked at all: a NaN backoff cannot be stored as a retry time."""
    from onward.config import RunConfig

    with pytest.raises(UsageError, match=says):
        RunConfig(max_retry_delay=value)


def test_task_settings_and_the_task_function_are_checked_when_registered(tmp_path: Path) -> None:
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)
    with pytest.raises(UsageError) as refused:
        job.task(timeout="600")(lambda task, ctx: task)  # type: ignore[call-overload]  # wrong on purpose
    assert_refuses_the_type(str(refused.value), "timeout", "600")
    # @job.task("prefix") (the policy given without replay=) was taken as the task function; every attempt
    # then failed with "'str' object is not callable".
    with pytest.raises(UsageError, match="@job.task takes a function, not str: 'prefix'"):
        job.task("prefix")  # type: ignore[call-overload]  # wrong on purpose
    job.close()


def test_paths_may_be_given_as_pathlib_paths(tmp_path: Path) -> None:
    """db, out and keep_awake take a pathlib.Path as well as a str (db raised TypeError before)."""
    marker = tmp_path / "keep-awake"
    seen: list[bool] = []
    job = Job(tmp_path / "s.db", out=tmp_path / "out", keep_awake=marker, log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        seen.append(marker.exists())
        return task.upper()

    job.add(["a"])
    assert job.run().exit_code == 0
    assert (tmp_path / "s.db").is_file() and (tmp_path / "out" / "a.txt").read_text() == "A"
    assert seen == [True] and not marker.exists()  # the marker was kept while the task ran
    job.close()


def test_result_send_and_cancel_look_names_up_as_add_stored_them(tmp_path: Path) -> None:
    """add([" a "]) stores "a"; result(" a ") raised TaskNotDone ("unknown") before, and send and cancel
    missed the task the same way."""
    job = Job(str(tmp_path / "s.db"), log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        return task.upper()

    job.add([" a "])
    assert job.run(install_signal_handlers=False).exit_code == 0
    job.add(["\tc\r\n", "\u3000d\u00a0"])
    assert job.result("  a\n") == "A"
    assert job.send(" c ", "approval", True) == "stored"
    assert job.cancel([" d "]) == {"d": "cancelled"}
    with pytest.raises(TypeError, match="cancel\\(\\) takes an iterable of task names, not a single str"):
        job.cancel("c")  # iterating it would cancel a task named "c" by luck, and "ab" as "a" and "b"
    with pytest.raises(TypeError, match="a task name must be a str, not int"):
        job.result(5)  # type: ignore[arg-type]  # wrong on purpose
    assert [(row.name, row.state) for row in job.store.iter_tasks(None)] == [
        ("a", "done"), ("c", "pending"), ("d", "cancelled")]
    job.close()


def test_a_jobs_output_folder_is_marked_as_its_own_as_the_clis_is(tmp_path: Path) -> None:
    """Job(out=DIR) marks DIR as its job's, like `onward run --out DIR`: another store's job (through the
    Python API or the CLI) is refused there before it writes anything, and the same job's CLI run is not."""
    out = tmp_path / "out"
    first = Job(str(tmp_path / "one.db"), out=str(out), log_level=QUIET)
    first.task(lambda task, ctx: f"one:{task}")
    first.add(["a"])
    first.run()
    first.close()
    assert (out / "a.txt").read_text() == "one:a"

    second = Job(str(tmp_path / "two.db"), out=str(out), log_level=QUIET)
    second.task(lambda task, ctx: f"two:{task}")
    second.add(["a"])
    with pytest.raises(UsageError, match="output folder"):
        second.run()
    assert second.store.counts()["done"] == 0
    second.close()
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    r = run_onward("run", "--db", str(tmp_path / "three.db"), "--tasks", str(tasks), "--out", str(out), "--", "echo", "x")
    assert r.returncode == 2 and b"output folder" in r.stderr, r.stderr
    assert (out / "a.txt").read_text() == "one:a"
    same = run_onward("run", "--db", str(tmp_path / "one.db"), "--out", str(out), "--", "echo", "x")
    assert same.returncode == 0, same.stderr


@pytest.mark.parametrize("carried_out", [True, False], ids=["answer_lost", "request_lost"])
def test_an_outcome_whose_commit_failed_waits_through_its_lease_and_only_its_fence_decides(
        store_url: str, monkeypatch: pytest.MonkeyPatch, carried_out: bool) -> None:
    """A commit that fails for the store (a connection cut) is taken as not made and tried again once the
    store answers. If the outage outlasts the task's lease, the outcome waiting for it was dropped as
    fenced, unasked: when the answer alone had been lost, the task was done in the store and this run's
    tally one short (with a log line saying 'not committing it'). An ended attempt runs nothing that could
    overlap another, so a lease running out no longer fences it: the try again is taken under the task's
    fence only. Here the commit that completes the first task and claims the next fails (in this process:
    the store's own class, wrapped), either after it was carried out (its answer lost) or before, then every
    statement of this worker fails until another worker, a process of its own, has taken over whatever
    leases ran out and finished the job. The first task ran once here. Its answer lost: it is told done,
    once, and its result is this run's. Its request lost: the other worker ran it again (it was never
    committed), and this outcome is refused as fenced, never written over the other's."""
    import threading

    from onward.errors import StoreUnavailable
    from onward.store import open_store

    store_class: Any = type(open_store(store_url))
    real_commit, real_exec = store_class.complete_and_claim, store_class._exec
    outage = threading.Event()
    lost: list[str] = []
    other: list[subprocess.CompletedProcess[bytes]] = []

    def take_over_then_end_the_outage() -> None:
        other.append(run_onward("run", "--db", store_url, "--heartbeat", "0.2", "--", "echo", "other", timeout=60))
        outage.clear()

    def cut_off() -> None:  # every statement fails during the outage (SQLite's complete_and_claim runs its
        if outage.is_set():  # own, without _exec: the hot path)
            raise StoreUnavailable("the server cannot be reached (test)")

    def complete_and_claim(self: Any, done: Any, *args: Any, **kwargs: Any) -> Any:
        if lost:
            cut_off()
            return real_commit(self, done, *args, **kwargs)
        if carried_out:
            real_commit(self, done, *args, **kwargs)
        lost.append(done.name)
        outage.set()
        threading.Thread(target=take_over_then_end_the_outage, daemon=True).start()
        raise StoreUnavailable("the server's answer was lost (test)" if carried_out else "connection cut (test)")

    def query(self: Any, *args: Any, **kwargs: Any) -> Any:
        cut_off()
        return real_exec(self, *args, **kwargs)

    monkeypatch.setattr(store_class, "complete_and_claim", complete_and_claim)
    monkeypatch.setattr(store_class, "_exec", query)
    names = [f"t{i}" for i in range(4)]
    calls: list[str] = []
    job = Job(store_url, log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        calls.append(task)
        return task.upper()

    job.add(names)
    summary = job.run(heartbeat=0.2, lease=1.0)
    assert lost == ["t0"] and other and other[0].returncode == 0, other
    assert calls == ["t0"], calls
    assert summary.counts["done"] == len(names), summary
    assert (summary.done, summary.fenced) == ((1, 0) if carried_out else (0, 1)), summary
    others = [job.result(name) for name in names[1:]]
    assert others == [b"other\n"] * 3, others
    assert job.result("t0") == ("T0" if carried_out else b"other\n")
    job.close()


def test_cancel_with_an_unknown_name_cancels_nothing(store_url: str) -> None:
    """job.cancel(["p", "nosuch"]) cancelled "p" and said "unknown" for the other; the README's rule (as for
    `onward cancel`, which exits 1 then) is that a typo among the names cancels nothing at all."""
    from onward import UnknownTask

    job = Job(store_url, log_level=QUIET)
    job.add(["p", "q"])
    with pytest.raises(UnknownTask, match="no task 'nosuch' in .*; nothing was cancelled"):
        job.cancel(["p", "nosuch"])
    assert job.store.counts()["pending"] == 2 and job.store.counts()["cancelled"] == 0
    assert job.cancel(["p", "p"]) == {"p": "cancelled"}
    job.close()
