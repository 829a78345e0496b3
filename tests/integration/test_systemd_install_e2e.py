"""`onward service install|status|uninstall` against a real systemd (PID 1 of a container booted with
systemd-nspawn, as in test_systemd_e2e.py): what they do with names, inputs and units of their own and of
others, checked in the container's /etc/systemd/system and through systemctl.
"""

from __future__ import annotations

import time

import pytest

from tests.integration.test_systemd_e2e import ONWARD, SRC, Container, container, wait_for

pytestmark = pytest.mark.systemd

__all__ = ["container"]  # the module's container, booted once for these tests

UNIT_DIR = "/etc/systemd/system"


def exists(container: Container, path: str) -> bool:
    return container.run("test", "-e", path, check=False).returncode == 0


def test_a_name_starting_with_a_dash_is_installed_queried_and_uninstalled(container: Container) -> None:
    # systemd accepts "-job.service"; systemctl must not take it for an option.
    job = container.work / "dash"
    job.mkdir()
    (job / "tasks.txt").write_text("a\n")
    install = container.run(*ONWARD, "service", "install", "--name=-job", "--workdir", str(job), "--env",
                            f"PYTHONPATH={SRC}", "--start-timeout", "45", "--", *ONWARD, "run", "--db", "job.db",
                            "--tasks", "tasks.txt", "--", "true", check=False)
    assert install.returncode == 0, install.stderr
    assert container.run("systemctl", "is-enabled", "--", "-job.service").stdout.strip() == "enabled"
    # systemd took the unit's TimeoutStartSec, not its DefaultTimeoutStartSec.
    shown = container.run("systemctl", "show", "-p", "TimeoutStartUSec", "--", "-job.service").stdout
    assert shown.strip() == "TimeoutStartUSec=45s", shown
    status = container.run(*ONWARD, "service", "status", "--", "-job", check=False)
    assert status.returncode == 0 and status.stdout.startswith("-job.service: "), status
    removed = container.run(*ONWARD, "service", "uninstall", "--", "-job", check=False)
    assert removed.returncode == 0, removed.stderr
    assert not exists(container, f"{UNIT_DIR}/-job.service")


def test_a_unit_that_could_never_start_is_refused_and_nothing_is_installed(container: Container) -> None:
    job = container.work / "never"
    job.mkdir()
    cases = {
        "the working directory": (["--workdir", str(job / "missing")], [*ONWARD, "run", "--", "true"]),
        "not an executable file": (["--workdir", str(job)], [str(job / "no-such-program"), "x"]),
        "no such user": (["--workdir", str(job), "--user", "no-such-user"], [*ONWARD, "run", "--", "true"]),
    }
    for i, (said, (options, command)) in enumerate(cases.items()):
        unit = f"onward-never-{i}.service"
        done = container.run(*ONWARD, "service", "install", "--name", unit, *options, "--", *command, check=False)
        assert done.returncode == 2, (said, done.returncode, done.stderr)
        assert done.stderr.startswith("onward: error: ") and said in done.stderr and done.stderr.count("\n") == 1
        assert not exists(container, f"{UNIT_DIR}/{unit}"), said
        assert container.run("systemctl", "is-enabled", unit, check=False).stdout.strip() != "enabled"


ADMIN_UNIT = "[Unit]\nDescription=an admin's own service\n[Service]\nExecStart=/bin/sleep infinity\n"


def test_a_unit_onward_did_not_write_is_neither_replaced_nor_removed(container: Container) -> None:
    job = container.work / "foreign"
    job.mkdir()
    (job / "tasks.txt").write_text("a\n")
    command = [*ONWARD, "run", "--db", "job.db", "--tasks", "tasks.txt", "--", "true"]
    # An admin's unit in /etc/systemd/system, and a packaged-like one elsewhere on the unit path (/run),
    # both running.
    for path in (f"{UNIT_DIR}/admin.service", "/run/systemd/system/packaged.service"):
        container.run("sh", "-c", 'printf %s "$1" > "$2"', "sh", ADMIN_UNIT, path)
    container.run("systemctl", "daemon-reload")
    container.run("systemctl", "start", "admin.service", "packaged.service")
    pids = {unit: container.show(unit)["MainPID"] for unit in ("admin.service", "packaged.service")}
    for unit, path in (("admin.service", f"{UNIT_DIR}/admin.service"),
                       ("packaged.service", "/run/systemd/system/packaged.service")):
        done = container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job), "--env",
                             f"PYTHONPATH={SRC}", "--", *command, check=False)
        assert done.returncode == 2 and "choose another --name" in done.stderr, (unit, done.stderr)
        assert container.run("cat", path).stdout == ADMIN_UNIT
        state = container.show(unit)
        assert state["ActiveState"] == "active" and state["MainPID"] == pids[unit], (unit, state)
    assert not exists(container, f"{UNIT_DIR}/packaged.service")
    done = container.run(*ONWARD, "service", "uninstall", "admin", check=False)
    assert done.returncode == 2 and "not written by onward" in done.stderr, done.stderr
    assert container.run("cat", f"{UNIT_DIR}/admin.service").stdout == ADMIN_UNIT
    assert container.show("admin.service")["MainPID"] == pids["admin.service"]

    # Its own unit, onward installs again over (the new command is taken into use) and removes.
    for tasks in ("a\n", "b\n"):
        (job / "tasks.txt").write_text(tasks)
        container.run(*ONWARD, "service", "install", "--name", "mine", "--workdir", str(job), "--env",
                      f"PYTHONPATH={SRC}", "--", *command)
    container.run(*ONWARD, "service", "uninstall", "mine")
    assert not exists(container, f"{UNIT_DIR}/mine.service")
    container.run("systemctl", "stop", "admin.service", "packaged.service")


@pytest.mark.postgres
@pytest.mark.torture  # 90 s; the suite checks the 12 s spacing it relies on (test_unavailable_store.py)
def test_a_database_outage_at_start_outlasts_the_start_limit_and_the_job_resumes(container: Container) -> None:
    # Status 75 is restarted by the unit (Restart=on-failure), but systemd counts every start toward the
    # start limit (6 in 60 s): a worker that exits 75 at once used it up in 3 s and the unit stayed failed
    # after the server came back.
    from onward.store import open_store
    from onward.store.base import DONE
    from tests import pgutil

    job = container.work / "outage"
    job.mkdir()
    unit = "onward-outage.service"
    with pgutil.private_cluster() as cluster:
        url = cluster.url(cluster.create_database("onward"))
        store = open_store(url)
        store.add([f"t{i}" for i in range(5)])
        store.close()
        cluster.ctl("stop")
        container.run(*ONWARD, "service", "install", "--name", unit, "--workdir", str(job), "--env",
                      f"PYTHONPATH={SRC}", "--", *ONWARD, "run", "--db", url, "--", "true",
                      check=False)  # `restart` reports the failed start
        outage_began = time.monotonic()
        # Longer than the start limit's 6 starts could last at 0.1 s apart plus a worker's start-up, and
        # beyond a whole StartLimitIntervalSec: the unit must still be trying.
        wait_for(lambda: time.monotonic() - outage_began > 65 or container.show(unit)["ActiveState"] == "failed",
                 90, "65 s of outage")
        state = container.show(unit)
        assert state["ActiveState"] != "failed", (state, container.journal(unit)[-3000:])
        assert int(state["NRestarts"]) >= 4, state  # it did keep trying
        cluster.ctl("start")
        wait_for(lambda: container.show(unit)["ActiveState"] in ("inactive", "failed"), 60, "the job to end")
        state = container.show(unit)
        assert state["Result"] == "success", (state, container.journal(unit)[-3000:])
        store = open_store(url, create=False)
        assert store.counts()[DONE] == 5
        store.close()
    container.run(*ONWARD, "service", "uninstall", unit)


def test_a_user_who_cannot_write_the_units_is_told_so_in_one_line(container: Container) -> None:
    job = container.work / "not-root"
    job.mkdir()
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    container.run(*ONWARD, "service", "install", "--name", "theirs", "--workdir", str(job), "--env",
                  f"PYTHONPATH={SRC}", "--", *ONWARD, "run", "--db", "job.db", "--", "true", check=False)
    for args in (["install", "--name", "mine", "--workdir", "/tmp", "--env", "API_TOKEN=t0k", "--", "/bin/true"],
                 ["uninstall", "theirs"]):
        done = container.run(*as_nobody, *ONWARD, "service", *args, check=False)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr == f"onward: error: cannot write to {UNIT_DIR}: install and uninstall services as root\n"
    assert not exists(container, f"{UNIT_DIR}/mine.service") and not exists(container, "/etc/onward/mine.env")
    assert exists(container, f"{UNIT_DIR}/theirs.service")
    container.run(*ONWARD, "service", "uninstall", "theirs")
