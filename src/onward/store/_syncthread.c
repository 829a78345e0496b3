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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/eventfd.h>
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
    int wake_fd;        /* eventfd, owned */
    double linger;
    uint64_t requested, done, waited;
    struct timespec done_at;
    int woke;           /* wake_fd was written for the sync that finished last */
    int error;          /* errno of the first failed fdatasync; 0 while none failed */
} SyncThread;

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
            uint64_t target = self->requested;
            int fd = self->fd;
            pthread_mutex_unlock(&self->mu);
            int rc = fdatasync(fd);
            int failed = rc == 0 ? 0 : (errno ? errno : EIO);
            pthread_mutex_lock(&self->mu);
            if (failed && !self->error)
                self->error = failed;
            self->done = target;
            self->woke = 0;
            clock_gettime(CLOCK_MONOTONIC, &self->done_at);
            pthread_cond_broadcast(&self->cv);
            continue;
        }
        if (self->done > self->waited && !self->woke) {
            struct timespec at;
            deadline_after(&at, &self->done_at, self->linger);
            int rc = pthread_cond_timedwait(&self->cv, &self->mu, &at);
            if (rc == ETIMEDOUT && !self->stopping && self->requested == self->done
                && self->done > self->waited && !self->woke) {
                uint64_t one = 1;
                if (write(self->wake_fd, &one, sizeof one) < 0) { /* full: it is readable anyway */ }
                self->woke = 1;
            }
            continue;
        }
        pthread_cond_wait(&self->cv, &self->mu);
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
    self->closed = 0;
    return (PyObject *)self;
}

static PyObject *closed_error(void) {
    PyErr_SetString(PyExc_ValueError, "the sync thread is closed");
    return NULL;
}

static PyObject *SyncThread_request(SyncThread *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
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
    uint64_t ticket = ++self->requested;
    pthread_cond_broadcast(&self->cv);
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromUnsignedLongLong(ticket);
}

static PyObject *SyncThread_wait(SyncThread *self, PyObject *arg) {
    unsigned long long ticket = PyLong_AsUnsignedLongLong(arg);
    if (ticket == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (self->closed)
        return closed_error();
    pthread_mutex_lock(&self->mu);
    if (ticket > self->requested) {
        pthread_mutex_unlock(&self->mu);
        PyErr_SetString(PyExc_ValueError, "no such ticket");
        return NULL;
    }
    if (self->done < ticket) {
        Py_BEGIN_ALLOW_THREADS
        while (self->done < ticket && !self->stopping)
            pthread_cond_wait(&self->cv, &self->mu);
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
    pthread_cond_broadcast(&self->cv);  /* the thread's linger wait: the sync it waits on was claimed */
    pthread_mutex_unlock(&self->mu);
    if (error) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
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
    {"request", (PyCFunction)SyncThread_request, METH_O,
     "request(fd) -> ticket: sync fd on the thread; everything written to it before this call is covered."},
    {"wait", (PyCFunction)SyncThread_wait, METH_O,
     "wait(ticket): return once the sync of that request has returned; OSError if any sync failed."},
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

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_syncthread",
                                       "fdatasync on a thread that never takes the GIL", -1, NULL};

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
