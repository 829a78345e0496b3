/* onward.store._syncthread: fdatasync a file on a thread of its own, so that the worker runs on meanwhile.
 *
 * Why (see SqliteStore.sync_ahead and Runner._report_settled). At concurrency 1 a Python task's thread
 * commits the task's outcome with the next claim (crash-safe), and the outcome may be reported only once
 * that commit is on stable storage. Syncing there and then puts the fsync on the path from one task to the
 * next. A Python thread could sync beside it, but it needs the GIL to hand the result back, and every
 * hand-over of the GIL between two busy threads costs a context switch. This thread never touches the
 * interpreter: it waits on a pthread condition, calls fdatasync and records how far it got.
 *
 * Tickets: `request(fd)` asks for a sync of everything written to fd so far and returns a ticket; the
 * thread syncs once for every request made while it was busy (one fdatasync covers them all);
 * `wait(ticket)` returns once a sync started after that request has returned. The first failed fdatasync
 * is kept: every later `wait` raises it (pages that failed to be written may have been dropped, so
 * nothing after it can be vouched for; the caller stops trusting this thread).
 *
 * A finished sync nobody waited for within `linger` seconds makes `fileno()` (an eventfd) readable: the
 * owner of what waits on that sync (the worker's loop) should then come and wait for it. `wait` reads the
 * eventfd back, so it is readable only while such a sync is unclaimed.
 *
 * `request(fd, probe_fd)` also has each fdatasync of fd that returned 0 followed by a probe of the journal
 * of probe_fd's filesystem (`journal_probe`, below); a refusal counts as a failed sync.
 *
 * `request(fd, probe_fd, gather)` with gather > 0: nobody waits for this sync yet, so it may start up to
 * `gather` seconds after the request, covering the requests made meanwhile with the same fdatasync (the
 * worker commits every moment: its loop at concurrency above 1, a Python task's own thread at concurrency 1;
 * and an fdatasync costs the machine's CPUs about as much as a short command). A `wait` for any ticket, or a
 * request with no gather, starts it at once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/eventfd.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;  /* on CLOCK_MONOTONIC: the thread's linger wait is not moved by clock jumps */
    pthread_t thread;
    pid_t owner;        /* the process that started the thread: a forked child has no such thread */
    int started, stopping, closed;
    int fd;             /* the file of the latest request */
    int probe_fd;       /* the file it named for the journal probe; -1: none */
    int wake_fd;        /* eventfd, owned */
    double linger;
    uint64_t requested, done, waited;
    struct timespec done_at;
    int woke;           /* wake_fd was written for the sync that finished last */
    int gather;         /* the next sync waits until gather_until (a request asked for it, none since said no) */
    struct timespec gather_until;
    int idle;           /* the thread waits on cv for a request (or lingers): a request must wake it */
    int gathering;      /* the thread waits on cv until gather_until: a request with no gather, or a wait,
                         * must wake it */
    int waiters;        /* callers of wait() waiting on cv: a finished sync must wake them */
    int error;          /* errno of the first failed fdatasync; 0 while none failed */
    int probing;        /* 1 until the file's filesystem turned out to take no journal probe */
} SyncThread;

/* Whether the filesystem of fd still takes a journal transaction, asked right after an fdatasync of a
 * file on it returned 0: 0 if it does, an errno if it refuses one (EROFS, EIO, EUCLEAN: its journal
 * aborted or it turned read-only), -1 if this filesystem cannot be asked (no user extended attributes;
 * nothing known).
 *
 * Why. ext4 aborts its journal on an error, and only a moment later (milliseconds: it writes its
 * superblock first) refuses writes. An fdatasync in between can return 0 for an append whose block
 * mapping or size was in a transaction the abort threw away: after a remount the data is gone (seen on
 * Linux 6.18 with errors=remount-ro; see the README, "What a sync is trusted with"). The abort is never
 * undone while the filesystem is mounted, and a loss like that needs it to have happened before the
 * fdatasync returned; so a transaction started after that return finds the journal aborted.
 *
 * How: replacing an extended attribute the file does not have (XATTR_REPLACE of PROBE_XATTR). ext4 starts
 * a journal handle for it (ext4_xattr_set), which fails with EROFS once the journal aborted, and only then
 * finds that there is nothing to replace (ENODATA): nothing is changed, not even the file's ctime. Until
 * 2026-12-07 the probe was fallocate(KEEP_SIZE) of the file's first byte, which changes no size and no
 * block but does change the ctime: a change in the journal's running transaction, which the next fdatasync
 * of any file then had to commit instead of only flushing the disk's cache (a 4 KiB overwrite and its
 * fdatasync: 157 us after such a probe, 95 us without, 90 us after this one; BENCHMARKS.md, steps). A
 * refusal after an fdatasync that did keep its data (an abort a moment after it) only leaves that sync
 * not vouched for: a task run again at worst, never a completion lost. */
#define PROBE_XATTR "user.onward-journal-probe"

static int journal_probe(int fd) {
    if (fsetxattr(fd, PROBE_XATTR, "", 0, XATTR_REPLACE) == 0)
        return 0; /* someone made the attribute: replaced by an empty value, a journal handle all the same */
    switch (errno) {
    case ENODATA:
        return 0; /* the journal took the handle; there was nothing to replace */
    case EROFS: case EIO: case EUCLEAN:
        return errno;
    case EOPNOTSUPP: case ENOSYS: case EINVAL: case ENODEV: case EBADF: case EPERM: case EACCES:
        return -1; /* no user attributes here (a FIFO, a device, a filesystem without them): not asked */
    default:  /* EINTR, ENOSPC, EDQUOT, ...: not a sign of a refused journal */
        return 0;
    }
}

static void deadline_after(struct timespec *at, const struct timespec *from, double seconds) {
    long long ns = (long long)from->tv_nsec + (long long)(seconds * 1e9);
    at->tv_sec = from->tv_sec + (time_t)(ns / 1000000000LL);
    at->tv_nsec = (long)(ns % 1000000000LL);
}

static void *run(void *arg) {
    SyncThread *self = (SyncThread *)arg;
    pthread_mutex_lock(&self->mu);
    while (!self->stopping) {
        if (self->requested > self->done) {
            if (self->gather && !self->waiters) {
                /* Woken early by a request with no gather, a wait, or close. */
                self->gathering = 1;
                int rc = pthread_cond_timedwait(&self->cv, &self->mu, &self->gather_until);
                self->gathering = 0;
                if (rc == ETIMEDOUT)
                    self->gather = 0;
                continue;
            }
            self->gather = 0;  /* a request made from here on opens a window of its own */
            uint64_t target = self->requested;
            int fd = self->fd, probe_fd = self->probe_fd;
            pthread_mutex_unlock(&self->mu);
            int rc = fdatasync(fd);
            int failed = rc == 0 ? 0 : (errno ? errno : EIO);
            int refused = failed || !self->probing || probe_fd < 0 ? 0 : journal_probe(probe_fd);
            pthread_mutex_lock(&self->mu);
            if (refused < 0)
                self->probing = 0;
            else if (refused > 0)
                failed = refused;
            if (failed && !self->error)
                self->error = failed;
            __atomic_store_n(&self->done, target, __ATOMIC_RELEASE);  /* read without the lock by finished() */
            self->woke = 0;
            clock_gettime(CLOCK_MONOTONIC, &self->done_at);
            if (self->waiters)
                pthread_cond_broadcast(&self->cv);
            continue;
        }
        if (self->done > self->waited && !self->woke) {
            struct timespec at;
            deadline_after(&at, &self->done_at, self->linger);
            self->idle = 1;
            int rc = pthread_cond_timedwait(&self->cv, &self->mu, &at);
            self->idle = 0;
            if (rc == ETIMEDOUT && !self->stopping && self->requested == self->done
                && self->done > self->waited && !self->woke) {
                uint64_t one = 1;
                if (write(self->wake_fd, &one, sizeof one) < 0) { /* full: it is readable anyway */ }
                self->woke = 1;
            }
            continue;
        }
        self->idle = 1;
        pthread_cond_wait(&self->cv, &self->mu);
        self->idle = 0;
    }
    pthread_mutex_unlock(&self->mu);
    return NULL;
}

static PyObject *SyncThread_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"linger", NULL};
    double linger = 0.02;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &linger))
        return NULL;
    if (!(linger >= 0.0 && linger <= 3600.0)) {
        PyErr_SetString(PyExc_ValueError, "linger must be between 0 and 3600 seconds");
        return NULL;
    }
    SyncThread *self = (SyncThread *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->closed = 1;  /* until everything below is set up: dealloc then releases nothing */
    self->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (self->wake_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(self);
        return NULL;
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&self->cv, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&self->mu, NULL);
    self->linger = linger;
    self->fd = -1;
    self->probe_fd = -1;
    self->probing = 1;
    self->closed = 0;
    return (PyObject *)self;
}

static PyObject *closed_error(void) {
    PyErr_SetString(PyExc_ValueError, "the sync thread is closed");
    return NULL;
}

static PyObject *SyncThread_request(SyncThread *self, PyObject *args) {
    long fd, probe_fd = -1;
    double gather = 0.0;
    if (!PyArg_ParseTuple(args, "l|ld", &fd, &probe_fd, &gather))
        return NULL;
    if (fd < 0 || fd > INT32_MAX || probe_fd < -1 || probe_fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    if (!(gather >= 0.0 && gather <= 3600.0)) {
        PyErr_SetString(PyExc_ValueError, "gather must be between 0 and 3600 seconds");
        return NULL;
    }
    if (self->closed)
        return closed_error();
    if (self->started && self->owner != getpid()) {
        PyErr_SetString(PyExc_RuntimeError, "the sync thread belongs to the parent of this forked process");
        return NULL;
    }
    pthread_mutex_lock(&self->mu);
    if (!self->started) {
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);  /* the thread takes no signal: they are Python's */
        int rc = pthread_create(&self->thread, NULL, run, self);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        if (rc != 0) {
            pthread_mutex_unlock(&self->mu);
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        self->started = 1;
        self->owner = getpid();
    }
    self->fd = (int)fd;
    self->probe_fd = (int)probe_fd;
    uint64_t ticket = ++self->requested;
    if (gather <= 0.0) {
        self->gather = 0;
    } else if (!self->gather) {
        /* The first request since the last sync started: the window opens now (a request made while
         * gathering keeps the window it found). */
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        deadline_after(&self->gather_until, &now, gather);
        self->gather = 1;
    }
    if (self->idle || (self->gathering && gather <= 0.0))
        /* otherwise it is syncing, and looks at `requested` again once that returns, or gathering */
        pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromUnsignedLongLong(ticket);
}

/* The ticket `arg` names, into *ticket: 0, or -1 with an exception set (not a ticket, or closed). */
static int ticket_of(SyncThread *self, PyObject *arg, unsigned long long *ticket) {
    *ticket = PyLong_AsUnsignedLongLong(arg);
    if (*ticket == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (self->closed) {
        closed_error();
        return -1;
    }
    return 0;
}

static PyObject *SyncThread_wait(SyncThread *self, PyObject *arg) {
    unsigned long long ticket;
    if (ticket_of(self, arg, &ticket) < 0)
        return NULL;
    pthread_mutex_lock(&self->mu);
    if (ticket > self->requested) {
        pthread_mutex_unlock(&self->mu);
        PyErr_SetString(PyExc_ValueError, "no such ticket");
        return NULL;
    }
    if (self->done < ticket) {
        Py_BEGIN_ALLOW_THREADS
        self->waiters++;
        if (self->gathering)  /* start the sync now */
            pthread_cond_broadcast(&self->cv);
        while (self->done < ticket && !self->stopping)
            pthread_cond_wait(&self->cv, &self->mu);
        self->waiters--;
        Py_END_ALLOW_THREADS
    }
    if (ticket > self->waited)
        self->waited = ticket;
    if (self->woke) {
        uint64_t count;
        if (read(self->wake_fd, &count, sizeof count) < 0) { /* already read: nothing to take back */ }
        self->woke = 0;
    }
    int error = self->done < ticket ? EBADF : self->error;  /* closed while waiting: never synced */
    /* The thread, lingering on the sync just claimed, is not woken for it: its linger ends in nothing (see run). */
    pthread_mutex_unlock(&self->mu);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *SyncThread_finished(SyncThread *self, PyObject *arg) {
    unsigned long long ticket;
    if (ticket_of(self, arg, &ticket) < 0)
        return NULL;
    /* Without the lock: asked at every turn of a busy loop, it would contend with the thread for it. */
    return PyBool_FromLong(__atomic_load_n(&self->done, __ATOMIC_ACQUIRE) >= ticket);
}

static PyObject *SyncThread_fileno(SyncThread *self, PyObject *unused) {
    if (self->closed)
        return closed_error();
    return PyLong_FromLong(self->wake_fd);
}

static void stop(SyncThread *self) {
    if (self->closed)
        return;
    self->closed = 1;
    if (self->started && self->owner == getpid()) {
        pthread_mutex_lock(&self->mu);
        self->stopping = 1;
        pthread_cond_broadcast(&self->cv);
        pthread_mutex_unlock(&self->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(self->thread, NULL);  /* after its fdatasync, if one is under way */
        Py_END_ALLOW_THREADS
    }
    close(self->wake_fd);
    self->wake_fd = -1;
}

static PyObject *SyncThread_close(SyncThread *self, PyObject *unused) {
    stop(self);
    Py_RETURN_NONE;
}

static void SyncThread_dealloc(SyncThread *self) {
    stop(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef SyncThread_methods[] = {
    {"request", (PyCFunction)SyncThread_request, METH_VARARGS,
     "request(fd, probe_fd=-1, gather=0) -> ticket: sync fd on the thread (everything written to it before this "
     "call is covered), then probe the journal through probe_fd (see journal_probe); with gather > 0, start that "
     "sync up to gather seconds later, unless a wait or a request with no gather comes first."},
    {"wait", (PyCFunction)SyncThread_wait, METH_O,
     "wait(ticket): return once the sync of that request has returned; OSError if any sync failed."},
    {"finished", (PyCFunction)SyncThread_finished, METH_O,
     "finished(ticket) -> bool: whether the sync of that request has returned (well or not: `wait` tells), "
     "without waiting."},
    {"fileno", (PyCFunction)SyncThread_fileno, METH_NOARGS,
     "fileno() -> the eventfd readable while a finished sync has gone unclaimed for `linger` seconds."},
    {"close", (PyCFunction)SyncThread_close, METH_NOARGS,
     "close(): stop the thread (after its sync under way, if any). Idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SyncThreadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "onward.store._syncthread.SyncThread",
    .tp_basicsize = sizeof(SyncThread),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SyncThread(linger=0.02): fdatasync files on a thread of its own.",
    .tp_new = SyncThread_new,
    .tp_dealloc = (destructor)SyncThread_dealloc,
    .tp_methods = SyncThread_methods,
};

static PyObject *py_journal_probe(PyObject *module, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return NULL;
    }
    int refused;
    Py_BEGIN_ALLOW_THREADS
    refused = journal_probe((int)fd);
    Py_END_ALLOW_THREADS
    if (refused > 0) {
        errno = refused;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyBool_FromLong(refused == 0);
}

static PyMethodDef module_methods[] = {
    {"journal_probe", (PyCFunction)py_journal_probe, METH_O,
     "journal_probe(fd) -> bool: after an fdatasync on fd's filesystem returned, whether it still takes a journal "
     "transaction (True), or cannot be asked (False); OSError if it refuses one (its journal aborted)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_syncthread",
                                       "fdatasync on a thread that never takes the GIL", -1, module_methods};

PyMODINIT_FUNC PyInit__syncthread(void) {
    if (PyType_Ready(&SyncThreadType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&moduledef);
    if (module == NULL)
        return NULL;
    Py_INCREF(&SyncThreadType);
    if (PyModule_AddObject(module, "SyncThread", (PyObject *)&SyncThreadType) < 0) {
        Py_DECREF(&SyncThreadType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
