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

-- name: set_meta
INSERT INTO meta (key, value) VALUES ('app', 'onward'), ('schema_version', :version)
ON CONFLICT (key) DO UPDATE SET value = excluded.value;

-- name: add_task
INSERT OR IGNORE INTO tasks (name, added_at) VALUES (:name, :now);

-- name: count_added
UPDATE counts SET n = n + :added WHERE state = 'pending';

-- name: claim
UPDATE tasks
   SET state = 'running', attempts = attempts + 1, fence = fence + 1, max_attempts = :max_attempts,
       worker_id = :worker_id, lease_until = :now + :lease, heartbeat_at = :now, progress_at = :now,
       note = NULL,
       started_at = :now, child_pid = NULL, child_start = NULL
 WHERE id IN (SELECT id FROM tasks
               WHERE state = 'pending' AND ready_at <= :now
               ORDER BY ready_at, id
               LIMIT :limit)
RETURNING id, name, attempts, fence, max_attempts;

-- name: renew
UPDATE tasks
   SET lease_until = :now + :lease,
       heartbeat_at = :now,
       progress_at = coalesce(:progress_at, progress_at),
       note = coalesce(:note, note)
 WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: worker_beat
UPDATE workers SET heartbeat_at = :now, done = :completed WHERE id = :worker_id;

-- name: note_child
UPDATE tasks SET child_pid = :pid, child_start = :start WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: complete
UPDATE tasks
   SET state = 'done', finished_at = :now, result = :result, result_kind = :kind, error = NULL,
       worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running';

-- name: fail
UPDATE tasks
   SET state = CASE WHEN attempts >= max_attempts THEN 'failed' ELSE 'pending' END,
       ready_at = CASE WHEN attempts >= max_attempts THEN ready_at ELSE :now + :delay END,
       finished_at = CASE WHEN attempts >= max_attempts THEN :now ELSE NULL END,
       error = :error, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state, attempts;

-- name: release
UPDATE tasks
   SET state = 'pending', attempts = attempts - 1, worker_id = NULL, lease_until = NULL,
       child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING attempts;

-- name: reclaim
-- An attempt that recorded a step further than any before it (furthest_step_fence is its fence) is given
-- back uncounted, as by a release; any other attempt counts, and fails the task once attempts are used up.
UPDATE tasks
   SET state = CASE WHEN furthest_step_fence <> :fence AND attempts >= max_attempts THEN 'failed'
                    ELSE 'pending' END,
       attempts = CASE WHEN furthest_step_fence = :fence THEN attempts - 1 ELSE attempts END,
       finished_at = CASE WHEN furthest_step_fence <> :fence AND attempts >= max_attempts THEN :now ELSE NULL END,
       error = CASE WHEN furthest_step_fence <> :fence AND attempts >= max_attempts THEN :reason ELSE error END,
       fence = fence + 1, worker_id = NULL, lease_until = NULL, child_pid = NULL, child_start = NULL
 WHERE id = :task_id AND fence = :fence AND state = 'running'
RETURNING state, furthest_step_fence <> :fence;

-- name: running
SELECT t.id, t.name, t.attempts, t.fence, t.worker_id, w.host, w.host_key, w.pid, w.pid_start,
       t.child_pid, t.child_start, t.lease_until < :now, :now - t.heartbeat_at, :now - t.progress_at, t.note
  FROM tasks AS t INDEXED BY tasks_running LEFT JOIN workers AS w ON w.id = t.worker_id
 WHERE t.state = 'running';

-- name: retry_failed
UPDATE tasks SET state = 'pending', attempts = 0, ready_at = 0, finished_at = NULL
 WHERE state = 'failed'
RETURNING id;

-- name: retry_one
UPDATE tasks SET state = 'pending', attempts = 0, ready_at = 0, finished_at = NULL
 WHERE name = :name AND state = 'failed'
RETURNING id;

-- name: task
SELECT name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE name = :key;

-- name: task_id
SELECT id FROM tasks WHERE name = :key;

-- name: result
SELECT result_kind, result FROM tasks WHERE name = :key AND state = 'done';

-- name: iter_tasks
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after ORDER BY id LIMIT :limit;

-- name: iter_tasks_in_state
SELECT id, name, state, attempts, added_at, started_at, finished_at, error, result_kind
  FROM tasks WHERE id > :after AND state = :state ORDER BY id LIMIT :limit;

-- name: counts
SELECT state, n FROM counts;

-- name: live_workers
SELECT w.id, w.host, w.host_key, w.pid, w.pid_start, w.started_at, :now - w.heartbeat_at,
       w.stopped_at, w.stop_reason, w.done,
       (SELECT count(*) FROM tasks AS t WHERE t.worker_id = w.id AND t.state = 'running')
  FROM workers AS w
 WHERE w.stopped_at IS NULL
 ORDER BY w.id DESC
 LIMIT 100;

-- name: count_restarts
SELECT count(*) FROM events WHERE kind = 'restart';

-- name: count_done_since_event
SELECT count(*) FROM events WHERE id >= :since AND kind = 'done';

-- name: event_time
SELECT at FROM events WHERE id = :id;

-- name: last_event_id
SELECT coalesce(max(id), 0) FROM events;

-- name: recent_errors
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e LEFT JOIN tasks AS t ON t.id = e.task_id
 WHERE e.kind IN ('failed', 'retrying', 'reclaimed', 'fenced')
 ORDER BY e.id DESC
 LIMIT :limit;

-- name: register_worker
INSERT INTO workers (host, host_key, pid, pid_start, started_at, heartbeat_at, detail)
VALUES (:host, :host_key, :pid, :pid_start, :now, :now, :detail)
RETURNING id;

-- name: worker_stopped
UPDATE workers SET stopped_at = :now, stop_reason = :reason WHERE id = :worker_id AND stopped_at IS NULL;

-- name: log_event
INSERT INTO events (at, kind, pid, host, worker_id, task_id, attempt, detail)
VALUES (:now, :kind, :pid, :host, :worker_id, :task_id, :attempt, :detail);

-- name: events_after
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e LEFT JOIN tasks AS t ON t.id = e.task_id
 WHERE e.id > :after
 ORDER BY e.id
 LIMIT :limit;

-- name: events_after_for_task
SELECT e.id, e.at, e.kind, e.pid, e.host, t.name, e.attempt, e.detail
  FROM events AS e JOIN tasks AS t ON t.id = e.task_id
 WHERE e.id > :after AND t.name = :key
 ORDER BY e.id
 LIMIT :limit;

-- name: get_source
SELECT identity, size, lines, mtime_ns, head_digest, tail_digest FROM sources WHERE path = :path;

-- name: set_source
INSERT INTO sources (path, identity, size, lines, mtime_ns, head_digest, tail_digest)
VALUES (:path, :identity, :size, :lines, :mtime_ns, :head_digest, :tail_digest)
ON CONFLICT (path) DO UPDATE
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
