"""The loop's inbox once the loop has closed it: a task's thread may still finish after the worker left (its
attempt was given back on the way out). Its outcome is dropped and a store call is refused; neither touches
the closed wake-up pipe, whose descriptor number may already belong to another file."""

from __future__ import annotations

import os

import pytest

from onward.attempt import Attempt, Outcome
from onward.errors import Fenced
from onward.inbox import LoopInbox
from onward.store.base import Claim


def test_a_closed_inbox_drops_outcomes_and_refuses_store_calls_without_writing_to_its_old_pipe() -> None:
    inbox = LoopInbox()
    inbox.loop_thread = -1  # posts come from "another thread": an open inbox would write a wake-up byte
    inbox.close()
    # Another file now holds the descriptor numbers the pipe had (the lowest free ones are reused).
    read_end, write_end = os.pipe()
    try:
        attempt = Attempt(Claim(task_id=1, name="t", attempt=1, fence=1, max_attempts=3))
        inbox.post(attempt, Outcome.done(b"", "text"))
        assert not inbox.has_finished()
        with pytest.raises(Fenced):
            inbox.store_call(lambda store: None)
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):
            os.read(read_end, 1)  # nothing was written into the file that took the pipe's place
    finally:
        os.close(read_end)
        os.close(write_end)
