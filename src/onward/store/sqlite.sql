-- onward's SQLite store: the schema, then every query the backend runs, each under "-- name: ...".
-- Times are seconds since the epoch (REAL) on this host's clock. See store/base.py for the contract.

-- name: schema
-- Version 1; every later version is a migrate_to_N below, applied in order, to new stores as to old ones.
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
) WITHOUT ROWID;

CREATE TABLE workers (
    id          INTEGER PRIMARY KEY,
    host        TEXT    NOT NULL,
    host_key    TEXT    NOT NULL,
    pid         INTEGER NOT NULL,
    pid_start   INTEGER NOT NULL,
    started_at  REAL    NOT NULL,
    heartbeat_at REAL   NOT NULL,
    stopped_at  REAL,
    stop_reason TEXT,
    done        INTEGER NOT NULL DEFAULT 0,
    detail      TEXT
);
CREATE INDEX workers_live ON workers (id) WHERE stopped_at IS NULL;

CREATE TABLE tasks (
    id           INTEGER PRIMARY KEY,
    name         TEXT    NOT NULL UNIQUE,
    state        TEXT    NOT NULL DEFAULT 'pending',
    attempts     INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL DEFAULT 3,
    fence        INTEGER NOT NULL DEFAULT 0,
    ready_at     REAL    NOT NULL DEFAULT 0,   -- a pending task is not claimed before this (retry backoff)
    worker_id    INTEGER,                      -- the owner while running
    lease_until  REAL,
    heartbeat_at REAL,                         -- the owner's last lease renewal
    progress_at  REAL,                         -- the task's last sign of progress (beat, output)
    note         TEXT,                         -- the last progress note (ctx.beat)
    child_pid    INTEGER,                      -- the command's process group, while running
    child_start  INTEGER,
    added_at     REAL    NOT NULL,
    started_at   REAL,
    finished_at  REAL,
    error        TEXT,
    result_kind  TEXT,
    result       BLOB
    -- furthest_step, furthest_step_fence: added by migrate_to_2
);
-- Claims take the oldest ready task: fresh tasks have ready_at 0, so they go in the order they were
-- added, and a retry waits for its backoff and then for the tasks that were already waiting.
CREATE INDEX tasks_ready ON tasks (ready_at, id) WHERE state = 'pending';
CREATE INDEX tasks_running ON tasks (worker_id) WHERE state = 'running';

-- Task counts per state, kept by the triggers below (and by add, which counts its inserts once) so that
-- `onward status` never scans a million rows.
CREATE TABLE counts (
    state TEXT PRIMARY KEY,
    n     INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO counts (state, n) VALUES ('pending', 0), ('running', 0), ('done', 0), ('failed', 0);

CREATE TRIGGER tasks_state_counted AFTER UPDATE OF state ON tasks
WHEN old.state <> new.state
BEGIN
    UPDATE counts SET n = n - 1 WHERE state = old.state;
    UPDATE counts SET n = n + 1 WHERE state = new.state;
END;

-- The journal. Events are appended in time order, so the rowid doubles as a time index.
CREATE TABLE events (
    id        INTEGER PRIMARY KEY,
    at        REAL    NOT NULL,
    kind      TEXT    NOT NULL,
    pid       INTEGER,
    host      TEXT,
    worker_id INTEGER,
    task_id   INTEGER,
    attempt   INTEGER,
    detail    TEXT
);
-- Partial indexes: only the rare rows are indexed, so the millions of claimed/done events cost nothing,
-- and status finds restarts and the latest errors without scanning the journal.
CREATE INDEX events_restarts ON events (id) WHERE kind = 'restart';
CREATE INDEX events_errors ON events (id) WHERE kind IN ('failed', 'retrying', 'reclaimed', 'fenced');

CREATE TABLE sources (
    path        TEXT PRIMARY KEY,
    identity    TEXT    NOT NULL,
    size        INTEGER NOT NULL,
    lines       INTEGER NOT NULL,
    mtime_ns    INTEGER NOT NULL,
    head_digest TEXT    NOT NULL,
    tail_digest TEXT    NOT NULL
) WITHOUT ROWID;

CREATE TABLE steps (
    task_id INTEGER NOT NULL,
    idx     INTEGER NOT NULL,
    name    TEXT    NOT NULL,
    kind    TEXT    NOT NULL,
    data    BLOB    NOT NULL,
    at      REAL    NOT NULL,
    PRIMARY KEY (task_id, idx)
) WITHOUT ROWID;

-- name: migrate_to_2
-- Each task keeps the furthest step index ever recorded for it (never lowered, not even when steps are
-- dropped) and the fence of the claim that reached it: a reclaim gives an attempt that got further back
-- uncounted, and counts one that did not (the poison rule). Steps recorded before the upgrade set the mark
-- but credit no claim.
ALTER TABLE tasks ADD COLUMN furthest_step INTEGER NOT NULL DEFAULT 0;
ALTER TABLE tasks ADD COLUMN furthest_step_fence INTEGER NOT NULL DEFAULT 0;
UPDATE tasks SET furthest_step = (SELECT max(idx) FROM steps WHERE steps.task_id = tasks.id)
 WHERE id IN (SELECT task_id FROM steps);

-- name: migrate_to_3
-- Named jobs, pause and cancel. A store holds several independent jobs: each task, journal row, worker and
-- import mark belongs to one (job_id), a task name is unique within its job, counts are kept per job, and a
-- job has a pause flag. The tasks of a version 2 store become the job "default" (id 1). Tables whose unique
-- key changes are rebuilt (SQLite cannot drop a constraint); the journal and the workers only gain a
-- column, whose default 1 costs no rewrite (every insert names its job). Also: the final state
-- 'cancelled', and the flag asking a running task's worker to cancel it.
-- A store that holds nothing yet (a new one, which runs every migration in turn) gets no job "default":
-- a job is made by the first run or add that names it, and one nobody made would be listed by `onward
-- jobs` and exported by `onward metrics` for ever, with no task. Its count rows go with it.
CREATE TABLE jobs (
    id         INTEGER PRIMARY KEY,
    name       TEXT    NOT NULL UNIQUE,
    paused     INTEGER NOT NULL DEFAULT 0,
    created_at REAL    NOT NULL
);
INSERT INTO jobs (id, name, created_at)
SELECT 1, 'default', coalesce((SELECT at FROM events ORDER BY id LIMIT 1), (julianday('now') - 2440587.5) * 86400.0)
 WHERE EXISTS (SELECT 1 FROM tasks) OR EXISTS (SELECT 1 FROM events) OR EXISTS (SELECT 1 FROM workers)
    OR EXISTS (SELECT 1 FROM sources) OR EXISTS (SELECT 1 FROM steps);

CREATE TABLE tasks_v3 (
    id           INTEGER PRIMARY KEY,
    job_id       INTEGER NOT NULL,
    name         TEXT    NOT NULL,
    state        TEXT    NOT NULL DEFAULT 'pending',
    attempts     INTEGER NOT NULL DEFAULT 0,
    max_attempts INTEGER NOT NULL DEFAULT 3,
    fence        INTEGER NOT NULL DEFAULT 0,
    ready_at     REAL    NOT NULL DEFAULT 0,
    worker_id    INTEGER,
    lease_until  REAL,
    heartbeat_at REAL,
    progress_at  REAL,
    note         TEXT,
    child_pid    INTEGER,
    child_start  INTEGER,
    added_at     REAL    NOT NULL,
    started_at   REAL,
    finished_at  REAL,
    error        TEXT,
    result_kind  TEXT,
    result       BLOB,
    furthest_step       INTEGER NOT NULL DEFAULT 0,
    furthest_step_fence INTEGER NOT NULL DEFAULT 0,
    cancel_requested    INTEGER NOT NULL DEFAULT 0,  -- running, and asked to be cancelled (see cancel)
    UNIQUE (job_id, name)
);
INSERT INTO tasks_v3 (id, job_id, name, state, attempts, max_attempts, fence, ready_at, worker_id, lease_until,
                      heartbeat_at, progress_at, note, child_pid, child_start, added_at, started_at, finished_at,
                      error, result_kind, result, furthest_step, furthest_step_fence)
SELECT id, 1, name, state, attempts, max_attempts, fence, ready_at, worker_id, lease_until, heartbeat_at,
       progress_at, note, child_pid, child_start, added_at, started_at, finished_at, error, result_kind, result,
       furthest_step, furthest_step_fence
  FROM tasks;
DROP TABLE tasks;
ALTER TABLE tasks_v3 RENAME TO tasks;
-- Every index leads with the job: a claim reads only its own job's ready tasks.
CREATE INDEX tasks_ready ON tasks (job_id, ready_at, id) WHERE state = 'pending';
CREATE INDEX tasks_running ON tasks (job_id, worker_id) WHERE state = 'running';
-- Failed and cancelled tasks are few: the dashboard's filter on them needs no scan of a million done ones.
CREATE INDEX tasks_ended_badly ON tasks (job_id, id) WHERE state IN ('failed', 'cancelled');
-- The finish times of done tasks, for the chart of a job's life (activity): each completion appends one
-- entry at the index's right edge (finish times grow), and the chart reads only what finished since its
-- last read.
CREATE INDEX tasks_done_at ON tasks (job_id, finished_at) WHERE state = 'done';

CREATE TABLE counts_v3 (
    job_id INTEGER NOT NULL,
    state  TEXT    NOT NULL,
    n      INTEGER NOT NULL,
    PRIMARY KEY (job_id, state)
) WITHOUT ROWID;
INSERT INTO counts_v3 (job_id, state, n) SELECT 1, state, n FROM counts WHERE EXISTS (SELECT 1 FROM jobs);
INSERT INTO counts_v3 (job_id, state, n) SELECT 1, 'cancelled', 0 WHERE EXISTS (SELECT 1 FROM jobs);
DROP TABLE counts;
ALTER TABLE counts_v3 RENAME TO counts;
CREATE TRIGGER tasks_state_counted AFTER UPDATE OF state ON tasks
WHEN old.state <> new.state
BEGIN
    UPDATE counts SET n = n - 1 WHERE job_id = old.job_id AND state = old.state;
    UPDATE counts SET n = n + 1 WHERE job_id = new.job_id AND state = new.state;
END;

ALTER TABLE events ADD COLUMN job_id INTEGER NOT NULL DEFAULT 1;
ALTER TABLE workers ADD COLUMN job_id INTEGER NOT NULL DEFAULT 1;
-- Resumed attempts that replayed recorded steps (the count in the detail), for Totals.step_replays.
CREATE INDEX events_replays ON events (id) WHERE kind = 'replayed';

CREATE TABLE sources_v3 (
    job_id      INTEGER NOT NULL,
    path        TEXT    NOT NULL,
    identity    TEXT    NOT NULL,
    size        INTEGER NOT NULL,
    lines       INTEGER NOT NULL,
    mtime_ns    INTEGER NOT NULL,
    head_digest TEXT    NOT NULL,
    tail_digest TEXT    NOT NULL,
    PRIMARY KEY (job_id, path)
) WITHOUT ROWID;
INSERT INTO sources_v3 SELECT 1, path, identity, size, lines, mtime_ns, head_digest, tail_digest FROM sources;
DROP TABLE sources;
ALTER TABLE sources_v3 RENAME TO sources;

-- name: migrate_to_4
-- Durable waits (ctx.wait / onward send). A task waiting for a value is parked in the state 'waiting': it
-- holds no worker and no lease, and ready_at is its deadline (1e300: none), so that a wait that times out
-- is claimed like a due retry. wait_key and wait_until name the wait it parked on (kept while it runs again,
-- so that its deadline survives the round trip; cleared once the wait is recorded). Values sent from
-- outside wait in the mailbox, one per (task, key), until the task takes them.
ALTER TABLE tasks ADD COLUMN wait_key TEXT;
ALTER TABLE tasks ADD COLUMN wait_until REAL;
CREATE INDEX tasks_waiting ON tasks (job_id, ready_at, id) WHERE state = 'waiting';
CREATE TABLE mailbox (
    task_id INTEGER NOT NULL,
    key     TEXT    NOT NULL,
    job_id  INTEGER NOT NULL,
    value   TEXT    NOT NULL,   -- JSON text
    sent_at REAL    NOT NULL,
    PRIMARY KEY (task_id, key)
) WITHOUT ROWID;
INSERT OR IGNORE INTO counts (job_id, state, n) SELECT id, 'waiting', 0 FROM jobs;

-- name: migrate_to_5
-- Fewer pages per completion. Version 4 kept three partial indexes on the hot path: pending tasks by
-- ready_at (claims), running ones by worker, done ones by finish time (the activity chart). A claim and a
-- completion wrote a leaf page of each: three of the six pages each task wrote to the log. One index
-- holds all three now, ranked so that their busy ends meet: done tasks (rank 0) by finish time, whose newest
-- entries are at the right edge of their range; then running ones (rank 1, a few); then pending ones
-- (rank 2) by ready_at, whose oldest entries (the next claims) are at the left edge of theirs. A claim moves
-- an entry from pending's left edge into running, a completion from running to done's right edge: the same
-- leaf page, mostly. Every query on these states names the two expressions exactly as here (SQLite uses an
-- index on expressions only then) and the index's WHERE term (to use a partial index).
DROP INDEX tasks_ready;
DROP INDEX tasks_running;
DROP INDEX tasks_done_at;
CREATE INDEX tasks_flow ON tasks (job_id, (state = 'running') + 2 * (state = 'pending'),
                                  CASE WHEN state = 'done' THEN finished_at ELSE ready_at END, id)
 WHERE state IN ('pending', 'running', 'done');

-- name: migrate_to_6
-- Tasks to run alone. A worker that dies with several tasks running (the OOM killer, a segfault, kill -9)
-- cannot tell which of them killed it: counting an attempt for each would fail the innocent ones along with
-- the culprit, after max_attempts such crashes. shared_crashes counts the crashes a task was in with others
-- (see reclaim): each gives it one attempt more (claim adds them to max_attempts; the attempt number still
-- grows, so that every execution of a command has its own ONWARD_ATTEMPT), and once there is one, the task
-- runs alone: a worker claims it only when it runs nothing else, and claims nothing beside it, so that a
-- crash while it runs is its own, and counts.
ALTER TABLE tasks ADD COLUMN shared_crashes INTEGER NOT NULL DEFAULT 0;
-- The pending ones, few: a busy worker asks at each heartbeat whether one is ready (alone_ready), and if
-- so claims nothing more until it runs nothing, then runs them one by one: they are not left until the job
-- has nothing else (never, while tasks keep coming).
CREATE INDEX tasks_alone ON tasks (job_id, ready_at) WHERE state = 'pending' AND shared_crashes > 0;

-- name: unstopped_workers
-- Before an upgrade (see sqlbase.refuse_live_workers): read from a store of any older version, so it names
-- only columns that the workers table has had since version 1.
SELECT host, host_key, pid, pid_start, :now - heartbeat_at FROM workers WHERE stopped_at IS NULL;

-- name: set_meta
INSERT INTO meta (key, value) VALUES ('app', 'onward'), ('schema_version', :version)
ON CONFLICT (key) DO UPDATE SET value = excluded.value;

-- Every query below reads or writes one job's rows (:job, the job's id), except those on the jobs table
-- and the journal's time lookups (event ids are global, and in time order).

-- name: find_job
SELECT id FROM jobs WHERE name = :name;

-- name: create_job
INSERT INTO jobs (name, created_at) VALUES (:name, :now) ON CONFLICT (name) DO NOTHING;

-- name: create_job_counts
INSERT OR IGNORE INTO counts (job_id, state, n)
VALUES (:job, 'pending', 0), (:job, 'running', 0), (:job, 'done', 0), (:job, 'failed', 0), (:job, 'cancelled', 0),
       (:job, 'waiting', 0);

-- name: jobs
SELECT j.name, j.paused, c.state, c.n FROM jobs AS j LEFT JOIN counts AS c ON c.job_id = j.id ORDER BY j.name;

-- name: paused
SELECT paused FROM jobs WHERE id = :job;

-- name: set_paused
UPDATE jobs SET paused = :paused WHERE id = :job AND paused <> :paused RETURNING id;

-- name: add_task
INSERT OR IGNORE INTO tasks (job_id, name, added_at) VALUES (:job, :name, :now);

-- name: count_added
UPDATE counts SET n = n + :added WHERE job_id = :job AND state = 'pending';

-- name: claim
-- A paused job claims nothing: checked here, once per statement, rather than by a read of its own. The order
-- names the time and id only: with the rank (fixed here) in it too, SQLite would sort instead of walking the
-- index. child_pid/child_start: the process made ready to run the claimed task's command (NULL: none),
-- noted with the claim (the caller passes one only when it claims one task). A task that was in a crash
-- with others runs alone: claimed only by a worker that will run nothing else beside it (:alone, with
-- :limit 1), and given an attempt more for each such crash (see migrate_to_6).
UPDATE tasks
   SET state = 'running', attempts = attempts + 1, fence = fence + 1,
       max_attempts = :max_attempts + shared_crashes,
       worker_id = :worker_id, lease_until = :now + :lease, heartbeat_at = :now, progress_at = :now,
       note = NULL, started_at = :now, child_pid = :child_pid, child_start = :child_start, cancel_requested = 0
 WHERE id IN (SELECT id FROM tasks INDEXED BY tasks_flow
               WHERE job_id = :job AND state IN ('pending', 'running', 'done')
                 AND (state = 'running') + 2 * (state = 'pending') = 2
                 AND CASE WHEN state = 'done' THEN finished_at ELSE ready_at END <= :now
                 AND NOT (SELECT paused FROM jobs WHERE id = :job)
                 AND (shared_crashes = 0 OR :alone)
               ORDER BY CASE WHEN state = 'done' THEN finished_at ELSE ready_at END, id
               LIMIT :limit)
RETURNING id, name, attempts, fence, max_attempts, shared_crashes > 0;

-- name: alone_ready
SELECT EXISTS (SELECT 1 FROM tasks INDEXED BY tasks_alone
                WHERE job_id = :job AND state = 'pending' AND shared_crashes > 0 AND ready_at <= :now);

-- name: next_ready_in
-- The first entry of the claim's range of the index (pending tasks by ready_at): where the next claim starts.
SELECT CASE WHEN state = 'done' THEN finished_at ELSE ready_at END - :now FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done')
   AND (state = 'running') + 2 * (state = 'pending') = 2
 ORDER BY CASE WHEN state = 'done' THEN finished_at ELSE ready_at END, id
 LIMIT 1;

-- name: renew
UPDATE tasks
   SET lease_until = :now + :lease,
       heartbeat_at = :now,
       progress_at = coalesce(:progress_at, progress_at),
       note = coalesce(:note, note)
 WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: worker_beat
UPDATE workers SET heartbeat_at = :now, done = :completed WHERE id = :worker_id;

-- name: cancelling
SELECT id FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 1 AND worker_id = :worker_id AND cancel_requested;

-- name: note_child
UPDATE tasks SET child_pid = :pid, child_start = :start WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: complete
-- An attempt that completes before its worker saw a cancel request ends done: its work is there.
UPDATE tasks
   SET state = 'done', finished_at = :now, result = :result, result_kind = :kind, error = NULL,
       worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL, cancel_requested = 0
 WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: fail
-- A task asked to be cancelled ends cancelled, whatever its attempts left: never retried.
UPDATE tasks
   SET state = CASE WHEN cancel_requested THEN 'cancelled' WHEN attempts >= max_attempts THEN 'failed'
                    ELSE 'pending' END,
       ready_at = CASE WHEN cancel_requested OR attempts >= max_attempts THEN ready_at ELSE :now + :delay END,
       finished_at = CASE WHEN cancel_requested OR attempts >= max_attempts THEN :now ELSE NULL END,
       error = :error, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state, attempts;

-- name: release
UPDATE tasks
   SET state = CASE WHEN cancel_requested THEN 'cancelled' ELSE 'pending' END,
       finished_at = CASE WHEN cancel_requested THEN :now ELSE finished_at END,
       attempts = attempts - 1, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state;

-- name: reclaim
-- An attempt that recorded a step further than any before it (furthest_step_fence is its fence) is given
-- back uncounted, as by a release. One whose worker ran other tasks beside it (:shared, whatever its steps)
-- does not count either, by an attempt more instead (its number is not used again: see migrate_to_6), and
-- the task runs alone from then on. Any other attempt counts, and fails the task once attempts are used up.
-- A task asked to be cancelled ends cancelled.
UPDATE tasks
   SET state = CASE WHEN cancel_requested THEN 'cancelled'
                    WHEN furthest_step_fence <> :fence AND NOT :shared AND attempts >= max_attempts THEN 'failed'
                    ELSE 'pending' END,
       attempts = CASE WHEN furthest_step_fence = :fence AND NOT :shared THEN attempts - 1 ELSE attempts END,
       max_attempts = max_attempts + :shared,
       finished_at = CASE WHEN cancel_requested
                               OR (furthest_step_fence <> :fence AND NOT :shared AND attempts >= max_attempts)
                          THEN :now ELSE NULL END,
       error = CASE WHEN furthest_step_fence <> :fence AND NOT :shared AND attempts >= max_attempts THEN :reason
                    ELSE error END,
       shared_crashes = shared_crashes + :shared,
       fence = fence + 1, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state, furthest_step_fence <> :fence AND NOT :shared;

-- name: running
SELECT t.id, t.name, t.attempts, t.fence, t.worker_id, w.host, w.host_key, w.pid, w.pid_start,
       t.child_pid, t.child_start, t.lease_until < :now, :now - t.heartbeat_at, :now - t.progress_at, t.note
  FROM tasks AS t INDEXED BY tasks_flow LEFT JOIN workers AS w ON w.id = t.worker_id
 WHERE t.job_id = :job AND t.state IN ('pending', 'running', 'done')
   AND (t.state = 'running') + 2 * (t.state = 'pending') = 1;

-- name: running_one
-- One running task as `running` reads it, for a reclaim that decides under the write lock (BEGIN IMMEDIATE,
-- which every renewal takes too): what it reads cannot change before it commits.
SELECT t.id, t.name, t.attempts, t.fence, t.worker_id, w.host, w.host_key, w.pid, w.pid_start,
       t.child_pid, t.child_start, t.lease_until < :now, :now - t.heartbeat_at, :now - t.progress_at, t.note
  FROM tasks AS t LEFT JOIN workers AS w ON w.id = t.worker_id
 WHERE t.id = :task_id AND t.fence = :fence AND t.state = 'running';

-- name: retry_failed
UPDATE tasks SET state = 'pending', attempts = 0, ready_at = 0, finished_at = NULL,
                 wait_key = NULL, wait_until = NULL  -- a retry starts its waits afresh
 WHERE id IN (SELECT id FROM tasks INDEXED BY tasks_ended_badly
              WHERE job_id = :job AND state IN ('failed', 'cancelled') AND state = 'failed')
RETURNING id;

-- name: retry_one
UPDATE tasks SET state = 'pending', attempts = 0, ready_at = 0, finished_at = NULL, cancel_requested = 0,
       wait_key = NULL, wait_until = NULL
 WHERE job_id = :job AND name = :name AND state IN ('failed', 'cancelled')
RETURNING id;

-- name: cancel_pending
UPDATE tasks SET state = 'cancelled', finished_at = :now
 WHERE job_id = :job AND name = :key AND state = 'pending'
RETURNING id;

-- name: cancel_waiting
UPDATE tasks SET state = 'cancelled', finished_at = :now
 WHERE job_id = :job AND name = :key AND state = 'waiting'
RETURNING id;

-- name: cancel_running
UPDATE tasks SET cancel_requested = 1
 WHERE job_id = :job AND name = :key AND state = 'running'
RETURNING id, attempts;

-- name: task
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE job_id = :job AND name = :key;

-- name: task_id
SELECT id FROM tasks WHERE job_id = :job AND name = :key;

-- name: result
SELECT result_kind, result FROM tasks WHERE job_id = :job AND name = :key AND state = 'done';

-- name: iter_tasks
-- Listing and paging walk the rowid from :after ("+job_id": not by the (job_id, name) index, which would
-- read the whole job and sort it); each page stops once it has its rows.
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after AND +job_id = :job ORDER BY id LIMIT :limit;

-- name: iter_tasks_in_state
-- Stops at :until too: a state rare among the ids (done tasks early in a job) would otherwise have a page
-- read every row after :after (the sweep for missing result files reads windows of ids).
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after AND id <= :until AND +job_id = :job AND state = :state ORDER BY id LIMIT :limit;

-- name: task_page_search
-- A substring search cannot use an index: it reads rows from :after on until it has a page or reaches
-- :until (fast when matches are common; a rare one reads every row up to :until). LIKE folds ASCII case
-- only.
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after AND id <= :until AND +job_id = :job AND name LIKE :pattern ESCAPE '\'
 ORDER BY id LIMIT :limit;

-- name: task_page_search_in_state
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after AND id <= :until AND +job_id = :job AND state = :state
   AND name LIKE :pattern ESCAPE '\'
 ORDER BY id LIMIT :limit;

-- name: iter_tasks_ended_badly
-- Failed or cancelled tasks (:state), from their own small index.
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks INDEXED BY tasks_ended_badly
 WHERE job_id = :job AND state IN ('failed', 'cancelled') AND state = :state AND id > :after
   AND (:pattern IS NULL OR name LIKE :pattern ESCAPE '\')
 ORDER BY id LIMIT :limit;

-- name: counts
SELECT state, n FROM counts WHERE job_id = :job;

-- name: live_workers
SELECT w.id, w.host, w.host_key, w.pid, w.pid_start, w.started_at, :now - w.heartbeat_at,
       w.stopped_at, w.stop_reason, w.done,
       (SELECT count(*) FROM tasks AS t INDEXED BY tasks_flow
         WHERE t.job_id = :job AND t.state IN ('pending', 'running', 'done')
           AND (t.state = 'running') + 2 * (t.state = 'pending') = 1 AND t.worker_id = w.id)
  FROM workers AS w
 WHERE w.stopped_at IS NULL AND w.job_id = :job
 ORDER BY w.id DESC
 LIMIT 100;

-- name: count_restarts
SELECT count(*) FROM events INDEXED BY events_restarts WHERE kind = 'restart' AND job_id = :job;

-- name: restarts_by_host
-- With max(), SQLite takes the bare columns (at, detail) from the row holding the maximum: each host's
-- latest restart.
SELECT coalesce(host, '?'), count(*), at, detail, max(id)
  FROM events INDEXED BY events_restarts
 WHERE kind = 'restart' AND job_id = :job
 GROUP BY coalesce(host, '?')
 ORDER BY 1;

-- name: count_done_since
-- Tasks of this job done since :since (a time), up to :cap, counted in the index of finish times (tasks_flow):
-- only this job's recent completions are read, not the journal of every job in the store, and at most :cap
-- of them, so that a refresh costs the same at any rate (done_at_rank measures a faster job).
SELECT count(*) FROM (
  SELECT 1 FROM tasks INDEXED BY tasks_flow
   WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 0
     AND CASE WHEN state = 'done' THEN finished_at ELSE ready_at END >= :since
   LIMIT :cap);

-- name: done_at_rank
-- When the job's (:rank + 1)-th latest completion finished: the same index walked from its newest end.
SELECT finished_at FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 0
 ORDER BY CASE WHEN state = 'done' THEN finished_at ELSE ready_at END DESC, id DESC
 LIMIT 1 OFFSET :rank;

-- name: event_time
SELECT at FROM events WHERE id = :id;

-- name: last_event_id
SELECT coalesce(max(id), 0) FROM events;

-- name: recent_errors
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e INDEXED BY events_errors LEFT JOIN tasks AS t ON t.id = e.task_id
 WHERE e.kind IN ('failed', 'retrying', 'reclaimed', 'fenced') AND e.job_id = :job
 ORDER BY e.id DESC
 LIMIT :limit;

-- name: activity_done
-- Completions per bucket since :since, from the index of finish times (see tasks_flow; the store handle
-- keeps the buckets already closed, so a live chart reads only the last few minutes).
SELECT CAST(CASE WHEN state = 'done' THEN finished_at ELSE ready_at END / :bucket AS INTEGER) * :bucket AS b, count(*)
  FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 0 AND CASE WHEN state = 'done' THEN finished_at ELSE ready_at END >= :since
 GROUP BY b;

-- name: activity_failed
-- Failed attempts come from the journal's small index of failures (fenced outcomes are not attempts of
-- their own: the reclaim that fenced them is counted).
SELECT CAST(at / :bucket AS INTEGER) * :bucket AS b, count(*)
  FROM events INDEXED BY events_errors
 WHERE kind IN ('failed', 'retrying', 'reclaimed', 'fenced') AND kind <> 'fenced' AND job_id = :job
 GROUP BY b;

-- name: count_failed_attempts
SELECT count(*) FROM events INDEXED BY events_errors
 WHERE kind IN ('failed', 'retrying', 'reclaimed', 'fenced') AND kind <> 'fenced' AND job_id = :job;

-- name: count_step_replays
-- A resumed attempt journals one 'replayed' event ("replayed 3 steps (saved 1.2 s)", see step_log.py) when
-- it first runs a step for real after replaying, or when it ends having only replayed.
SELECT coalesce(sum(CAST(substr(detail, length('replayed ') + 1) AS INTEGER)), 0)
  FROM events INDEXED BY events_replays
 WHERE kind = 'replayed' AND job_id = :job;

-- name: register_worker
INSERT INTO workers (job_id, host, host_key, pid, pid_start, started_at, heartbeat_at, detail)
VALUES (:job, :host, :host_key, :pid, :pid_start, :now, :now, :detail)
RETURNING id;

-- name: worker_stopped
UPDATE workers SET stopped_at = :now, stop_reason = :reason WHERE id = :worker_id AND stopped_at IS NULL;

-- name: log_events
-- Appends events in the order given; the braces stand for one row of nine placeholders per event (job,
-- at, kind, pid, host, worker_id, task_id, attempt, detail). A batch buffers its events and writes them
-- all with this one statement just before its commit.
INSERT INTO events (job_id, at, kind, pid, host, worker_id, task_id, attempt, detail)
VALUES {rows};

-- name: events_after
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e LEFT JOIN tasks AS t ON t.id = e.task_id
 WHERE e.id > :after AND e.job_id = :job
 ORDER BY e.id
 LIMIT :limit;

-- name: events_last
-- The job's last :limit events (newest first; the caller puts them in order): walks the journal backwards.
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e LEFT JOIN tasks AS t ON t.id = e.task_id
 WHERE e.job_id = :job
 ORDER BY e.id DESC
 LIMIT :limit;

-- name: iter_running_tasks
-- Running tasks are few: read from their index and sorted, rather than found among a million others.
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 1 AND id > :after
   AND (:pattern IS NULL OR name LIKE :pattern ESCAPE '\')
 ORDER BY id LIMIT :limit;

-- name: iter_pending_tasks
-- Pending tasks from their index, sorted: used when they are few among many others (see task_page).
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks INDEXED BY tasks_flow
 WHERE job_id = :job AND state IN ('pending', 'running', 'done') AND (state = 'running') + 2 * (state = 'pending') = 2 AND id > :after
   AND (:pattern IS NULL OR name LIKE :pattern ESCAPE '\')
 ORDER BY id LIMIT :limit;

-- name: events_after_for_task
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e JOIN tasks AS t ON t.id = e.task_id
 WHERE e.id > :after AND t.job_id = :job AND t.name = :key
 ORDER BY e.id
 LIMIT :limit;

-- name: get_source
SELECT identity, size, lines, mtime_ns, head_digest, tail_digest FROM sources WHERE job_id = :job AND path = :path;

-- name: set_source
INSERT INTO sources (job_id, path, identity, size, lines, mtime_ns, head_digest, tail_digest)
VALUES (:job, :path, :identity, :size, :lines, :mtime_ns, :head_digest, :tail_digest)
ON CONFLICT (job_id, path) DO UPDATE
   SET identity = excluded.identity, size = excluded.size, lines = excluded.lines, mtime_ns = excluded.mtime_ns,
       head_digest = excluded.head_digest, tail_digest = excluded.tail_digest;

-- name: steps
SELECT idx, name, kind, data, at FROM steps WHERE task_id = :task_id ORDER BY idx;

-- name: step_progress
-- First half of recording a step, in its transaction: checks the fence (no row: refused) and moves the
-- task's furthest step, crediting this claim when the step goes beyond it.
UPDATE tasks
   SET furthest_step_fence = CASE WHEN :idx > furthest_step THEN fence ELSE furthest_step_fence END,
       furthest_step = max(furthest_step, :idx)
 WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: record_step
INSERT OR REPLACE INTO steps (task_id, idx, name, kind, data, at) VALUES (:task_id, :idx, :name, :kind, :data, :at);

-- name: drop_steps
DELETE FROM steps
 WHERE task_id = :task_id AND idx >= :from_idx
   AND EXISTS (SELECT 1 FROM tasks WHERE id = :task_id AND fence = :fence AND state = 'running');

-- name: fence_holds
SELECT 1 FROM tasks WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: settled_under
SELECT state FROM tasks WHERE id = :task_id AND fence = :fence AND state <> 'running';

-- name: lock_task
-- The task's state. On PostgreSQL this takes the task's row lock, ordering a wait's steps against a send;
-- here every write holds the store's write lock (BEGIN IMMEDIATE) from its start, which orders them already.
SELECT state FROM tasks WHERE id = :task_id;

-- name: park
-- A task that waits for a value gives its claim back uncounted (as a release) and parks: 'waiting' until the
-- value comes (send) or its deadline (:until, NULL for none) passes (wake_due). A value already in the
-- mailbox (sent between the task's look and this) makes it pending at once; a cancel request ends it.
UPDATE tasks
   SET state = CASE WHEN cancel_requested THEN 'cancelled'
                    WHEN EXISTS (SELECT 1 FROM mailbox AS m WHERE m.task_id = :task_id AND m.key = :wait_key)
                    THEN 'pending' ELSE 'waiting' END,
       ready_at = CASE WHEN EXISTS (SELECT 1 FROM mailbox AS m WHERE m.task_id = :task_id AND m.key = :wait_key)
                       THEN 0 ELSE coalesce(:until, 1e300) END,
       finished_at = CASE WHEN cancel_requested THEN :now ELSE finished_at END,
       wait_key = :wait_key, wait_until = :until,
       attempts = attempts - 1, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state;

-- name: wake_due
-- Waits whose deadline passed become claimable (the task runs again and records the timeout). With :behind
-- (the clock was seen going back) so do those with a deadline claimed later than now: the clock was set back
-- since, and their deadline lies further ahead than promised; the task parks again until at most its wait's
-- length from now.
UPDATE tasks SET state = 'pending', ready_at = min(ready_at, :now)
 WHERE id IN (SELECT id FROM tasks INDEXED BY tasks_waiting
               WHERE job_id = :job AND state = 'waiting'
                 AND (ready_at <= :now OR (:behind AND ready_at < 1e300 AND started_at > :now)));

-- name: mail
-- The value waiting for a task's wait, and the deadline recorded when it parked on that wait.
SELECT (SELECT m.value FROM mailbox AS m WHERE m.task_id = t.id AND m.key = :wait_key),
       CASE WHEN t.wait_key = :wait_key THEN t.wait_until END
  FROM tasks AS t WHERE t.id = :task_id;

-- name: take_mail
-- With the wait's record (same transaction): the value is taken...
DELETE FROM mailbox WHERE task_id = :task_id AND key = :wait_key;

-- name: wait_done
-- ...and the task waits for nothing.
UPDATE tasks SET wait_key = NULL, wait_until = NULL WHERE id = :task_id;

-- name: send
INSERT INTO mailbox (task_id, key, job_id, value, sent_at) VALUES (:task_id, :wait_key, :job, :value, :now)
ON CONFLICT (task_id, key) DO NOTHING
RETURNING 1;

-- name: deliver
-- The task waits for this value: claimable at once (ready_at 0: it goes before tasks added after it).
UPDATE tasks SET state = 'pending', ready_at = 0
 WHERE id = :task_id AND state = 'waiting' AND wait_key = :wait_key
RETURNING id;

-- name: waits
-- Waiting tasks and what they wait for (status), from their own index.
SELECT name, wait_key, wait_until FROM tasks INDEXED BY tasks_waiting
 WHERE job_id = :job AND state = 'waiting'
 ORDER BY id LIMIT :limit;

-- name: iter_waiting_tasks
-- Waiting tasks, from their own index, as iter_running_tasks does for running ones.
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks INDEXED BY tasks_waiting
 WHERE job_id = :job AND state = 'waiting' AND id > :after
   AND (:pattern IS NULL OR name LIKE :pattern ESCAPE '\')
 ORDER BY id LIMIT :limit;
