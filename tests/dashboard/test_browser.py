"""The dashboard in a real headless browser (Debian's Chromium, driven by Playwright; no browser is ever
downloaded), on a store that a real ``onward run`` is working on.

Every wait is on a condition with a deadline. A screenshot is saved as a test artifact (into
$ONWARD_TEST_ARTIFACTS, else the test's tmp_path); with ONWARD_DOCS_SCREENSHOTS=1 it also becomes the
README's docs/dashboard.png.
"""

from __future__ import annotations

import os
import re
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_tool, run_onward, wait_for
from tests.dashboard.conftest import Served, status_of

XSS_NAME = "<img src=x onerror=alert(1)>"
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_MS = 30_000
# Flags for a machine without internet: without them Chromium stalls on connections it is refused.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = require_tool("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("playwright is needed (pip install -e '.[test]')")
        pytest.skip("needs playwright")
    with sync_playwright() as playwright:
        # A fresh profile in a temporary folder each launch (Playwright's default for launch()).
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("ONWARD_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def number(page: Any, element_id: str) -> int:
    text = page.locator(f"#{element_id}").text_content()
    return int(text) if text and text.isdigit() else -1


def test_the_page_follows_a_running_job_and_steers_it(browser: Any, job: Any, dashboard: Any,
                                                      tmp_path: Path) -> None:
    work = job(["blocker", "flaky-1", XSS_NAME, *[f"ok-{i}" for i in range(1, 61)]])
    (work.folder / "broken").touch()
    work.run("--concurrency", "2", "--max-attempts", "1")
    served: Served = dashboard(work.db, "--token", "s3cret-token")

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    dialogs: list[str] = []

    def on_dialog(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    page.goto(served.url + "?token=s3cret-token")
    page.wait_for_function("() => !location.search.includes('token')", timeout=DEADLINE_MS)
    page.evaluate("() => { window.sameDocument = true; }")  # gone if the page ever reloads
    page.locator("#live", has_text="live").wait_for(timeout=DEADLINE_MS)

    # The counts move without a reload, through the event stream (which needs the token too).
    page.wait_for_function("() => Number(document.getElementById('count-done').textContent) >= 1",
                           timeout=DEADLINE_MS)
    seen = number(page, "count-done")
    page.wait_for_function(f"() => Number(document.getElementById('count-done').textContent) > {seen}",
                           timeout=DEADLINE_MS)
    page.locator("#chart rect.done").first.wait_for(timeout=DEADLINE_MS)

    # The task named like HTML is text wherever it shows; nothing it holds ever runs.
    page.locator("#failures button", has_text=XSS_NAME).wait_for(timeout=DEADLINE_MS)
    page.locator("#failures button", has_text=XSS_NAME).click()
    page.locator("#detail-facts dd.state", has_text="failed").wait_for(timeout=DEADLINE_MS)
    assert page.locator("#detail-name").text_content() == XSS_NAME
    assert "<script>alert(2)</script>" in (page.locator("#detail-error").text_content() or "")
    assert page.evaluate("() => document.images.length + document.querySelectorAll('main script, aside *[onerror]').length") == 0
    page.locator("#detail-close").click()

    # Search, open the failed task, retry it: it runs again, and this time it is done.
    page.fill("#search", "flaky")
    page.wait_for_function("() => { const rows = document.querySelectorAll('#tasks tbody tr');"
                           " return rows.length === 1 && rows[0].textContent.includes('flaky-1'); }",
                           timeout=DEADLINE_MS)
    page.locator("#tasks tbody button", has_text="flaky-1").click()
    page.locator("#detail-facts dd.state", has_text="failed").wait_for(timeout=DEADLINE_MS)
    (work.folder / "broken").unlink()
    page.locator("#detail-retry").click()
    page.locator("#detail-facts dd.state", has_text="done").wait_for(timeout=DEADLINE_MS)
    outcomes = page.locator("#detail-attempts tbody tr td:nth-child(4)").all_text_contents()
    assert outcomes == ["failed", "done"], outcomes
    assert run_onward("result", "--db", work.db, "flaky-1").stdout == b"result of flaky-1\n"
    page.locator("#detail-close").click()

    # Pause: the store's flag is set, the worker finishes what it holds and claims nothing more.
    page.locator("#pause-toggle", has_text="Pause").click()
    page.locator("#paused-badge").wait_for(state="visible", timeout=DEADLINE_MS)
    assert status_of(work.db)["paused"] is True
    drained = wait_for(lambda: (lambda s: s if [t["task"] for t in s["tasks_running"]] == ["blocker"] else None)(
        status_of(work.db)), 30, "the tasks running at the pause to end")
    pending = drained["pending"]  # type: ignore[index]
    assert pending > 0, "the job ran out of tasks before the pause could be seen"
    _wait_for_heartbeats(work.db, 2)  # the worker's loop turned (and would have claimed) since
    assert status_of(work.db)["pending"] == pending

    page.locator("#pause-toggle", has_text="Resume").click()
    page.locator("#paused-badge").wait_for(state="hidden", timeout=DEADLINE_MS)
    assert status_of(work.db)["paused"] is False
    wait_for(lambda: status_of(work.db)["pending"] < pending, 30, "claims to start again after the resume")

    page.fill("#search", "")
    page.wait_for_function("() => document.querySelectorAll('#tasks tbody tr').length > 20", timeout=DEADLINE_MS)
    assert page.evaluate("() => window.sameDocument") is True
    assert dialogs == []
    shot = artifacts(tmp_path) / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("ONWARD_DOCS_SCREENSHOTS") == "1":
        # The README's picture: the top of the page.
        (ROOT / "docs").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "docs" / "dashboard.png"))
    page.close()


def _wait_for_heartbeats(db: str, renewals: int) -> None:
    """Wait until the (only) worker renewed its heartbeat ``renewals`` more times."""
    ages: list[float] = []
    seen = [0]

    def renewed() -> bool:
        (worker,) = status_of(db)["workers"]
        if ages and worker["heartbeat_age"] < ages[-1]:
            seen[0] += 1
        ages.append(worker["heartbeat_age"])
        return seen[0] >= renewals

    wait_for(renewed, 30, f"{renewals} heartbeats of the worker", interval=0.1)


def test_a_page_without_its_token_asks_for_it_then_cancels_and_retries(browser: Any, job: Any,
                                                                       dashboard: Any) -> None:
    work = job(["secret-task-name", "flaky-2"])
    (work.folder / "broken").touch()
    assert work.run("--max-attempts", "1").wait(timeout=120) == 3
    assert run_onward("add", "--db", work.db, "waiting-task").returncode == 0
    served: Served = dashboard(work.db, "--token", "s3cret-token")
    page = browser.new_page()
    page.goto(served.url)
    page.locator("#token-needed").wait_for(state="visible", timeout=DEADLINE_MS)
    assert "secret-task-name" not in page.content()
    page.fill("#token-input", "s3cret-token")
    page.locator("#token-use").click()
    page.locator("#tasks tbody button", has_text="secret-task-name").wait_for(timeout=DEADLINE_MS)
    page.locator("#live", has_text="live").wait_for(timeout=DEADLINE_MS)
    # The counts arrive with the first status event, which may come after the task table: wait for them.
    page.locator("#count-failed", has_text=re.compile(r"^1$")).wait_for(timeout=DEADLINE_MS)

    page.locator("#retry-failed").click()
    page.locator("#count-failed", has_text="0").wait_for(timeout=DEADLINE_MS)
    assert status_of(work.db)["pending"] == 2

    page.locator("#tasks tbody button", has_text="waiting-task").click()
    page.locator("#detail-facts dd.state", has_text="pending").wait_for(timeout=DEADLINE_MS)
    page.locator("#detail-cancel").click()
    page.locator("#detail-facts dd.state", has_text="cancelled").wait_for(timeout=DEADLINE_MS)
    assert status_of(work.db)["cancelled"] == 1
    page.locator("#detail-retry").click()
    page.locator("#detail-facts dd.state", has_text="pending").wait_for(timeout=DEADLINE_MS)
    assert status_of(work.db)["cancelled"] == 0
    page.close()


# A name whose right-to-left override makes it look like a text file; an error with an escape sequence that
# would retitle a terminal, a bell, a bidi isolate, a tab and line breaks.
SPOOF_NAME = "report\u202etxt.exe"
TROUBLE_STDERR = "\x1b]0;owned\x07 line one\u2067x\n\tline two\n"


def test_control_and_bidi_characters_of_the_store_are_shown_escaped_as_on_the_command_line(
        browser: Any, dashboard: Any, tmp_path: Path) -> None:
    db = str(tmp_path / "onward.db")
    tasks = tmp_path / "tasks.txt"
    tasks.write_text(f"{SPOOF_NAME}\nfails\n", encoding="utf-8")
    assert run_onward("add", "--db", db, "--tasks", str(tasks)).returncode == 0
    script = ("import sys\n"
              f"if sys.argv[1] == 'fails':\n    sys.stderr.write({TROUBLE_STDERR!r}); sys.exit(1)\n")
    ran = run_onward("run", "--db", db, "--max-attempts", "1", "-q", "--", sys.executable, "-c", script, "{task}")
    assert ran.returncode == 3, ran.stderr  # one task failed
    served: Served = dashboard(db, "--token", "s3cret-token")
    page = browser.new_page()
    page.goto(served.url + "?token=s3cret-token")

    spoof = page.locator("#tasks tbody button.task-name").first
    spoof.wait_for(timeout=DEADLINE_MS)
    assert spoof.text_content() == "report\\u202etxt.exe"
    assert spoof.get_attribute("title") == "report\\u202etxt.exe"
    page.locator("#failures button", has_text="fails").wait_for(timeout=DEADLINE_MS)

    page.locator("#failures button", has_text="fails").click()
    page.locator("#detail-facts dd.state", has_text="failed").wait_for(timeout=DEADLINE_MS)
    # The error's own block keeps its tab and line breaks, and escapes the rest.
    assert "\\x1b]0;owned\\x07 line one\\u2067x\n\tline two" in (page.locator("#detail-error").text_content() or "")
    page.locator("#detail-close").click()
    page.locator("#tasks tbody button.task-name").first.click()
    page.locator("#detail-facts dd.state", has_text="done").wait_for(timeout=DEADLINE_MS)
    assert page.locator("#detail-name").text_content() == "report\\u202etxt.exe"

    # Nowhere in the page is one of them left raw; the API still gives the stored text as it is.
    raw = page.evaluate("() => [...document.body.innerText, ...[...document.querySelectorAll('[title]')]"
                        ".map((e) => e.title).join('')].filter((c) => /[\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f"
                        "\\u2028\\u2029\\u202a-\\u202e\\u2066-\\u2069]/.test(c))")
    assert raw == [], raw
    assert served.get("/api/tasks/" + urllib.parse.quote(SPOOF_NAME)).json()["task"] == SPOOF_NAME
    page.close()
