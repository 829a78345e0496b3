/* onward._clonespawn: start a command's process from the worker itself, without forking the worker.
 *
 * Why (see onward/clonespawn.py for the Python side). A fork of the worker copies the page tables of a
 * multi-threaded interpreter; a spawner process's clone runs Python in the child, which faults in copies
 * of the pages it touches. Here the child is made with clone3(CLONE_VM): it shares the worker's memory, runs
 * on a stack of its own, and executes only the C function `child` below, which makes raw system calls and
 * touches nothing but that stack and the blocks the worker built for it (see `struct block`). So
 * nothing is copied, and its cost is about what vfork + execve cost xargs.
 *
 * Unlike vfork, the worker is not suspended: the child waits for its go (a futex word in its block) before
 * it runs its program, so that the worker can note its pid in the store first (nothing of the command has
 * run by then). The worker keeps the argument block and the stack until it has reaped the child (`Child.release`), since the
 * child reads them until its execve.
 *
 * A child may also be made before its command is known (`spawn` with None for the arguments): it sets
 * itself up and waits, and the worker gives it its program, arguments and environment (`Child.arm`) just
 * before the go. The worker makes the next command's process so while the current command runs, and notes
 * its pid in the same commit as the claim of the task it will run.
 *
 * Rules for `child` (it shares memory with a running, multi-threaded interpreter):
 * - only raw system calls through `sys6` (no libc: a failing libc call writes errno into the thread-local
 *   storage of the worker's thread, whose thread pointer the child shares);
 * - it is made with CLONE_CLEAR_SIGHAND, so it has none of the worker's handlers (the kernel resets every
 *   handled signal to the default in the child's copy of the table): a signal must never run the
 *   interpreter's handler on the child's stack. All signals are blocked from before the clone until just
 *   before execve as well;
 * - it writes only to its own stack and to the two words of its block that are its to say (`said`,
 *   `exec_errno`), which the worker reads once it has reaped it.
 *
 * x86_64 only (the clone3 entry and the system calls are written for it); elsewhere the module says it is
 * unavailable and the worker uses its spawner process.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__linux__)
#define ONWARD_CLONESPAWN 1
#else
#define ONWARD_CLONESPAWN 0
#endif

#if ONWARD_CLONESPAWN

#define NR_CLONE3 435
#define NR_CLOSE_RANGE 436
#define CLONE_VM_ 0x00000100ULL
#define CLONE_CLEAR_SIGHAND_ 0x100000000ULL
#define CLONE_INTO_CGROUP_ 0x200000000ULL
#define CLOSE_RANGE_CLOEXEC_ (1U << 2)
#define PR_SET_PDEATHSIG_ 1
#define FUTEX_WAIT_PRIVATE_ 128 /* FUTEX_WAIT | FUTEX_PRIVATE_FLAG */
#define FUTEX_WAKE_PRIVATE_ 129 /* FUTEX_WAKE | FUTEX_PRIVATE_FLAG */
#define CHILD_STACK (64 * 1024)

struct clone_args_v2 {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
        set_tid_size, cgroup;
};

/* The kernel's struct sigaction on x86_64 (handler, flags, restorer, mask). */
struct ksigaction {
    uintptr_t handler;
    unsigned long flags;
    uintptr_t restorer;
    uint64_t mask;
};

static inline long sys6(long nr, long a, long b, long c, long d, long e, long f) {
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret; /* -errno on failure */
}
#define sys3(nr, a, b, c) sys6((nr), (long)(a), (long)(b), (long)(c), 0, 0, 0)

/* What the child runs: built by the worker (before the clone, or before the go: `arm`), read by the child
 * after its go, until execve. */
struct arguments {
    char **paths;          /* where to look for the program, in order (NULL-terminated) */
    char **argv;           /* NULL-terminated */
    char **envp;           /* NULL-terminated */
    size_t size;           /* of the whole allocation (this header, the arrays, the strings) */
};

/* The go word (a futex): what the worker tells a waiting child. */
#define GO_WAIT 0
#define GO_RUN 1   /* run the command (its arguments are armed) */
#define GO_LEAVE 2 /* discarded: leave, running nothing */

/* What the child says, in words of its block the worker reads once it has reaped it. */
#define SAID_NOTHING 0
#define SAID_SET_UP 1 /* own session, PDEATHSIG, parent checked */
#define SAID_GOING 2  /* took its go: from here on it calls execve */

/* Everything else the child needs, built by the worker before the clone. */
struct block {
    int out, err, devnull;
    int go;                /* GO_WAIT, GO_RUN or GO_LEAVE: written by the worker, a futex the child waits on */
    int said;              /* SAID_*: written by the child */
    int exec_errno;        /* written by the child: why execve failed (positive), once said is SAID_GOING */
    int worker;            /* the pid the child's parent must have, else the worker died before the prctl */
    struct arguments *args; /* NULL until armed; read by the child only after its go */
    void *stack;           /* CHILD_STACK bytes */
    size_t size;           /* of the whole mapping (this block and the stack) */
};

static void child_exit(int code) {
    sys3(SYS_exit, code, 0, 0);
    for (;;) {
    }
}

/* In the new process: own session, die with the worker, say it is set up; wait for the go; run. It tells the
 * worker through words of its block (the memory they share until its execve), not pipes: two pipes a command
 * (four descriptors made and closed, a read and a write) cost the worker more than the loads and the futex
 * wake that replace them. */
__attribute__((noinline, used, optimize("no-stack-protector"))) static int child(struct block *b) {
    sys3(SYS_setsid, 0, 0, 0);
    sys6(SYS_prctl, PR_SET_PDEATHSIG_, SIGKILL, 0, 0, 0, 0);
    if (sys3(SYS_getppid, 0, 0, 0) != b->worker)
        child_exit(137); /* the worker died before the prctl: its signal was missed, do not run */
    __atomic_store_n(&b->said, SAID_SET_UP, __ATOMIC_RELEASE);

    /* The clone left no handler of the worker's here (CLONE_CLEAR_SIGHAND); the signals it ignores stay
     * ignored, but SIGPIPE and SIGXFSZ, which Python ignores, go back to the default, as subprocess does.
     * (This replaced asking the kernel about each of the 64 signals: 68 system calls a command.) */
    static const int restored[] = {SIGPIPE, SIGXFSZ};
    for (unsigned i = 0; i < sizeof restored / sizeof restored[0]; i++) {
        struct ksigaction dfl = {0};
        sys6(SYS_rt_sigaction, restored[i], (long)&dfl, 0, 8, 0, 0);
    }
    if (sys3(SYS_dup2, b->devnull, 0, 0) < 0 || sys3(SYS_dup2, b->out, 1, 0) < 0 ||
        sys3(SYS_dup2, b->err, 2, 0) < 0)
        child_exit(127);
    /* Only 0, 1 and 2 survive the execve: the worker's other descriptors, whichever thread opened them. */
    if (sys3(NR_CLOSE_RANGE, 3, ~0U, CLOSE_RANGE_CLOEXEC_) != 0)
        child_exit(127);

    /* Wait for the worker's word. A private futex: the child shares the worker's memory (CLONE_VM). The wait
     * returns at once if the word is no longer GO_WAIT, so a go given before the wait is not missed. */
    int go;
    while ((go = __atomic_load_n(&b->go, __ATOMIC_ACQUIRE)) == GO_WAIT)
        sys6(SYS_futex, (long)&b->go, FUTEX_WAIT_PRIVATE_, GO_WAIT, 0, 0, 0);
    if (go != GO_RUN)
        child_exit(0); /* discarded: nothing of the command runs */
    /* The worker stored the arguments before it set the go: the acquire load above orders them before us. */
    struct arguments *a = b->args;
    if (a == NULL)
        child_exit(127); /* a go without arguments: never given by the worker */
    __atomic_store_n(&b->said, SAID_GOING, __ATOMIC_RELEASE);

    uint64_t none = 0;
    sys6(SYS_rt_sigprocmask, SIG_SETMASK, (long)&none, 0, 8, 0, 0);
    /* As subprocess does: the first error other than "not there", else the last. */
    long first = 0, last = -ENOENT;
    for (char **path = a->paths; *path != NULL; path++) {
        last = sys3(SYS_execve, *path, a->argv, a->envp);
        if (first == 0 && last != -ENOENT && last != -ENOTDIR)
            first = last;
    }
    __atomic_store_n(&b->exec_errno, (int)-(first ? first : last), __ATOMIC_RELEASE);
    child_exit(127);
    return 0;
}

/* clone3 with a stack: the child starts on `stack`, calls child(b) and exits with its value. The
 * parent gets the pid, or -errno. Registers r12 and r13 survive the system call in both processes. */
static long clone3_child(struct clone_args_v2 *args, struct block *b) {
    long ret;
    register void *fn __asm__("r12") = (void *)child;
    register void *arg __asm__("r13") = b;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        "xor %%ebp, %%ebp\n\t"
        "mov %%r13, %%rdi\n\t"
        "call *%%r12\n\t"
        "mov %%eax, %%edi\n\t"
        "mov $60, %%eax\n\t" /* SYS_exit */
        "syscall\n\t"
        "hlt\n"
        "1:\n\t"
        : "=a"(ret)
        : "a"((long)NR_CLONE3), "D"(args), "S"(sizeof *args), "r"(fn), "r"(arg)
        : "rcx", "r11", "memory");
    return ret;
}

/* --- the Python side ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    struct block *block; /* NULL once released */
    int pid;
} Child;

static void child_dealloc(Child *self) {
    /* Never unmap memory a live child may still run on: a handle dropped without `release` (after the
     * child was reaped) leaks its block rather than pulling the stack from under a running child. */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The blocks (header and stack) of the last children reaped, kept for the next ones: a command then costs
 * the worker no mmap, no munmap (about 20 us here, on the path from one command's exit to the next one's go)
 * and no page faults on a fresh stack. Up to BLOCKS_KEPT of them: with one kept, a third of the commands at
 * concurrency 4 still took a fresh block, since more than one child is alive at once (4 commands and the
 * process made ahead). Only ever touched with the GIL held. Every block has the same size. */
#define BLOCKS_KEPT 8
static struct block *kept_blocks[BLOCKS_KEPT];
static int blocks_kept = 0;

static void *new_block(size_t size) {
    if (blocks_kept > 0)
        return kept_blocks[--blocks_kept];
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    return map == MAP_FAILED ? NULL : map;
}

/* Only for a block no process runs on any more: its child was reaped, or never made. */
static void drop_block(void *map, size_t size) {
    if (blocks_kept < BLOCKS_KEPT)
        kept_blocks[blocks_kept++] = map;
    else
        munmap(map, size);
}

static PyObject *child_release(Child *self, PyObject *Py_UNUSED(ignored)) {
    if (self->block != NULL) {
        free(self->block->args); /* NULL when never armed */
        drop_block(self->block, self->block->size);
        self->block = NULL;
    }
    Py_RETURN_NONE;
}

static struct arguments *build_arguments(PyObject *paths_in, PyObject *argv_in, PyObject *envp_in);

static PyObject *child_arm(Child *self, PyObject *args) {
    PyObject *paths_in, *argv_in, *envp_in;
    if (!PyArg_ParseTuple(args, "OOO", &paths_in, &argv_in, &envp_in))
        return NULL;
    if (self->block == NULL || self->block->args != NULL) {
        PyErr_SetString(PyExc_ValueError, "this child was released or has its arguments already");
        return NULL;
    }
    struct arguments *a = build_arguments(paths_in, argv_in, envp_in);
    if (a == NULL)
        return NULL;
    self->block->args = a; /* read by the child after the go, which the caller writes after this returns */
    Py_RETURN_NONE;
}

static PyObject *child_get_pid(Child *self, void *closure) { return PyLong_FromLong(self->pid); }

static PyObject *tell(Child *self, int word) {
    if (self->block == NULL) {
        PyErr_SetString(PyExc_ValueError, "this child was released");
        return NULL;
    }
    if (word == GO_RUN && self->block->args == NULL) {
        PyErr_SetString(PyExc_ValueError, "this child has no arguments to run");
        return NULL;
    }
    __atomic_store_n(&self->block->go, word, __ATOMIC_RELEASE);
    sys6(SYS_futex, (long)&self->block->go, FUTEX_WAKE_PRIVATE_, 1, 0, 0, 0);
    Py_RETURN_NONE;
}

static PyObject *child_go(Child *self, PyObject *Py_UNUSED(ignored)) { return tell(self, GO_RUN); }

static PyObject *child_leave(Child *self, PyObject *Py_UNUSED(ignored)) { return tell(self, GO_LEAVE); }

static PyObject *child_said(Child *self, PyObject *Py_UNUSED(ignored)) {
    if (self->block == NULL) {
        PyErr_SetString(PyExc_ValueError, "this child was released");
        return NULL;
    }
    int said = __atomic_load_n(&self->block->said, __ATOMIC_ACQUIRE);
    int failure = __atomic_load_n(&self->block->exec_errno, __ATOMIC_ACQUIRE);
    return Py_BuildValue("(ii)", said, failure);
}

static PyMethodDef child_methods[] = {
    {"release", (PyCFunction)child_release, METH_NOARGS,
     "Unmap the child's stack and arguments. Call only once it has been reaped."},
    {"arm", (PyCFunction)child_arm, METH_VARARGS,
     "arm(paths, argv, envp): give a child made without arguments what to run; then its go."},
    {"go", (PyCFunction)child_go, METH_NOARGS, "Let the child run its command (armed already)."},
    {"leave", (PyCFunction)child_leave, METH_NOARGS, "Make the child leave without running anything."},
    {"said", (PyCFunction)child_said, METH_NOARGS,
     "(said, errno) once reaped: 0 nothing (died before it set itself up), 1 set up, 2 took its go; and why its"
     " execve failed (0: it did not)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef child_getset[] = {{"pid", (getter)child_get_pid, NULL, "the child's pid", NULL},
                                     {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject ChildType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "onward._clonespawn.Child",
    .tp_basicsize = sizeof(Child),
    .tp_dealloc = (destructor)child_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A process made by clone: its pid, and its memory to release once it is reaped.",
    .tp_methods = child_methods,
    .tp_getset = child_getset,
};

/* Bytes for each item of a sequence of bytes objects; -1 with an exception set. */
static Py_ssize_t strings_size(PyObject *seq, Py_ssize_t *count) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "expected bytes");
            return -1;
        }
        if ((Py_ssize_t)strlen(PyBytes_AS_STRING(item)) != PyBytes_GET_SIZE(item)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte");
            return -1;
        }
        total += PyBytes_GET_SIZE(item) + 1;
    }
    *count = n;
    return total;
}

static char *copy_strings(PyObject *seq, char **array, char *text) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t len = PyBytes_GET_SIZE(item);
        memcpy(text, PyBytes_AS_STRING(item), (size_t)len + 1);
        array[i] = text;
        text += len + 1;
    }
    array[n] = NULL;
    return text;
}

/* The arguments, in one allocation of the worker's heap (header, arrays, strings); NULL with an exception
 * set. Freed once the child that reads them is reaped. */
static struct arguments *build_arguments(PyObject *paths_in, PyObject *argv_in, PyObject *envp_in) {
    PyObject *paths = NULL, *argv = NULL, *envp = NULL;
    struct arguments *result = NULL;
    paths = PySequence_Fast(paths_in, "paths must be a sequence");
    argv = PySequence_Fast(argv_in, "argv must be a sequence");
    envp = PySequence_Fast(envp_in, "envp must be a sequence");
    if (paths == NULL || argv == NULL || envp == NULL)
        goto done;
    Py_ssize_t np, na, ne, sp, sa, se;
    if ((sp = strings_size(paths, &np)) < 0 || (sa = strings_size(argv, &na)) < 0 ||
        (se = strings_size(envp, &ne)) < 0)
        goto done;
    if (na == 0) {
        PyErr_SetString(PyExc_ValueError, "argv must not be empty");
        goto done;
    }
    size_t head = (sizeof(struct arguments) + (size_t)(np + na + ne + 3) * sizeof(char *) + 15) & ~(size_t)15;
    size_t size = head + (size_t)(sp + sa + se);
    void *map = malloc(size); /* the worker's heap: the child reads it through the memory it shares */
    if (map == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct arguments *a = map;
    a->size = size;
    a->paths = (char **)(a + 1);
    a->argv = a->paths + np + 1;
    a->envp = a->argv + na + 1;
    char *cursor = (char *)map + head;
    cursor = copy_strings(paths, a->paths, cursor);
    cursor = copy_strings(argv, a->argv, cursor);
    copy_strings(envp, a->envp, cursor);
    result = a;
done:
    Py_XDECREF(paths);
    Py_XDECREF(argv);
    Py_XDECREF(envp);
    return result;
}

static PyObject *spawn(PyObject *module, PyObject *args) {
    PyObject *paths_in, *argv_in, *envp_in;
    int out, err, devnull, cgroup;
    if (!PyArg_ParseTuple(args, "OOOiiii", &paths_in, &argv_in, &envp_in, &out, &err, &devnull, &cgroup))
        return NULL;
    /* None for all three: a child that waits for `arm` (see the top of this file). */
    struct arguments *arguments = NULL;
    if (paths_in != Py_None || argv_in != Py_None || envp_in != Py_None) {
        arguments = build_arguments(paths_in, argv_in, envp_in);
        if (arguments == NULL)
            return NULL;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t size = (sizeof(struct block) + page - 1) / page * page + CHILD_STACK;
    void *map = new_block(size);
    if (map == NULL) {
        PyErr_SetFromErrno(PyExc_OSError);
        free(arguments);
        return NULL;
    }
    struct block *b = map;
    b->out = out, b->err = err, b->devnull = devnull;
    b->go = GO_WAIT, b->said = SAID_NOTHING, b->exec_errno = 0; /* (a kept block holds its last child's words) */
    b->worker = getpid();
    b->size = size;
    b->stack = (char *)map + size - CHILD_STACK;
    b->args = arguments;

    Child *handle = PyObject_New(Child, &ChildType);
    if (handle == NULL) {
        free(arguments);
        drop_block(map, size);
        return NULL;
    }
    handle->block = NULL;
    handle->pid = 0;

    struct clone_args_v2 ca;
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_VM_ | CLONE_CLEAR_SIGHAND_ | (cgroup >= 0 ? CLONE_INTO_CGROUP_ : 0);
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)b->stack;
    ca.stack_size = CHILD_STACK;
    ca.cgroup = cgroup >= 0 ? (uint64_t)cgroup : 0;

    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = clone3_child(&ca, b);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        /* no child: nothing runs on this memory */
        free(arguments);
        drop_block(map, size);
        Py_DECREF(handle);
        errno = (int)-pid;
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    handle->block = b;
    handle->pid = (int)pid;
    return (PyObject *)handle;
}

/* Whether this kernel lets us: clone3 with CLONE_CLEAR_SIGHAND (5.5) and CLONE_INTO_CGROUP (5.7) and
 * close_range with CLOEXEC (5.11), and no seccomp filter refuses them. Asked with requests the kernel must
 * refuse, as the spawner does. */
static PyObject *available(PyObject *module, PyObject *Py_UNUSED(ignored)) {
    struct clone_args_v2 ca;
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_VM_ | CLONE_CLEAR_SIGHAND_ | CLONE_INTO_CGROUP_;
    ca.exit_signal = SIGCHLD;
    ca.cgroup = 0x7FFFFFFF; /* no such descriptor: EBADF once the kernel got as far as the cgroup */
    char stack[64];
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = sizeof stack;
    long r = sys6(NR_CLONE3, (long)&ca, sizeof ca, 0, 0, 0, 0);
    if (r == 0)
        child_exit(0); /* cannot happen (no such descriptor); were it a child, it must not go on */
    if (r > 0) {
        waitpid((pid_t)r, NULL, 0);
        Py_RETURN_FALSE;
    }
    if (r != -EBADF)
        Py_RETURN_FALSE;
    int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        Py_RETURN_FALSE;
    long c = sys3(NR_CLOSE_RANGE, fd, fd, CLOSE_RANGE_CLOEXEC_);
    close(fd);
    if (c != 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

#else /* not x86_64 Linux */

static PyObject *available(PyObject *module, PyObject *Py_UNUSED(ignored)) { Py_RETURN_FALSE; }

static PyObject *spawn(PyObject *module, PyObject *args) {
    errno = ENOSYS;
    return PyErr_SetFromErrno(PyExc_OSError);
}

#endif

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS, "Whether spawn works on this system."},
    {"spawn", spawn, METH_VARARGS,
     "spawn(paths, argv, envp, out, err, devnull, cgroup) -> Child, waiting for Child.go; None for paths, argv"
     " and envp makes a child that waits for Child.arm first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_clonespawn",
                                       "Start commands with clone3(CLONE_VM) (see the C source).", -1, methods};

PyMODINIT_FUNC PyInit__clonespawn(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
#if ONWARD_CLONESPAWN
    if (PyType_Ready(&ChildType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    return m;
}
