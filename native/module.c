/* colifs._native.Engine: takes the tables Python computed, mounts, runs libfuse's multi-threaded
 * loop without the GIL, and calls back into Python only for control files, extended attributes
 * and read-path events (failures). Counters are shared memory, read through memoryviews.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "engine.h"

#include <errno.h>
#include <stddef.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    PyObject_HEAD engine_t e;
    PyObject *control, *xattr, *listxattr, *event;
    Py_buffer counters; /* Python's memory: it reads the counters while this engine writes them */
    int mounted, destroyed, have_counters;
    char **old_roots; /* mirrors' roots replaced by set_root, freed with the engine */
    size_t nold_roots;
} EngineObject;

#define WAKE_SIGNAL (SIGRTMIN + 5) /* interrupts the loop's wait once the session is told to exit */

static void wake(int sig) { (void)sig; }

/* -- calls into Python (from FUSE threads: take the GIL) --------------------------------------- */

/* The bytes a callable returned, copied; an int is an errno. */
static int take_bytes(PyObject *r, char **data, size_t *len) {
    if (!r) {
        PyErr_WriteUnraisable(NULL);
        return EIO;
    }
    int err = 0;
    if (PyLong_Check(r)) {
        err = (int)PyLong_AsLong(r);
        if (err <= 0)
            err = EIO;
    } else if (PyBytes_Check(r)) {
        *len = (size_t)PyBytes_GET_SIZE(r);
        *data = malloc(*len ? *len : 1);
        if (*data)
            memcpy(*data, PyBytes_AS_STRING(r), *len);
        else
            err = ENOMEM;
    } else {
        err = EIO;
    }
    Py_DECREF(r);
    return err;
}

static int py_control(void *py, uint64_t ino, uint32_t uid, char **data, size_t *len) {
    EngineObject *self = py;
    PyGILState_STATE g = PyGILState_Ensure();
    int err = take_bytes(PyObject_CallFunction(self->control, "KI", (unsigned long long)ino, (unsigned int)uid),
                         data, len);
    PyGILState_Release(g);
    return err;
}

static int py_xattr(void *py, uint64_t ino, const char *name, char **data, size_t *len) {
    EngineObject *self = py;
    PyGILState_STATE g = PyGILState_Ensure();
    int err = take_bytes(PyObject_CallFunction(self->xattr, "Ky", (unsigned long long)ino, name), data, len);
    PyGILState_Release(g);
    return err;
}

static int py_listxattr(void *py, uint64_t ino, char **data, size_t *len) {
    EngineObject *self = py;
    PyGILState_STATE g = PyGILState_Ensure();
    int err = take_bytes(PyObject_CallFunction(self->listxattr, "K", (unsigned long long)ino), data, len);
    PyGILState_Release(g);
    return err;
}

static void py_event(void *py, int kind, int drive, int32_t file, const char *text, int timed_out,
                     uint64_t successes, uint32_t gen) {
    EngineObject *self = py;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(self->event, "iiiy#iKI", kind, drive, (int)file, text,
                                        (Py_ssize_t)strlen(text), timed_out, (unsigned long long)successes,
                                        (unsigned int)gen);
    if (!r)
        PyErr_WriteUnraisable(self->event);
    Py_XDECREF(r);
    PyGILState_Release(g);
}

/* -- tables ------------------------------------------------------------------------------------ */

static char *dup_bytes(PyObject *b) {
    if (!PyBytes_Check(b)) {
        PyErr_SetString(PyExc_TypeError, "expected bytes");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(b);
    char *s = malloc((size_t)n + 1);
    if (!s) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(s, PyBytes_AS_STRING(b), (size_t)n);
    s[n] = 0;
    return s;
}

/* ns since the epoch as a timespec, whose nanoseconds are never negative (before 1970 too). */
static void set_time(struct timespec *t, long long ns) {
    long long sec = ns / 1000000000LL, rem = ns % 1000000000LL;
    if (rem < 0)
        sec -= 1, rem += 1000000000LL;
    t->tv_sec = (time_t)sec;
    t->tv_nsec = (long)rem;
}

static int load_nodes(engine_t *e, PyObject *nodes, size_t nchildren) {
    Py_ssize_t n = PySequence_Size(nodes);
    if (n < 0)
        return -1;
    e->nodes = calloc((size_t)n + 1, sizeof(node_t));
    if (!e->nodes) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_GetItem(nodes, i);
        if (!t)
            return -1;
        node_t *nd = &e->nodes[i];
        unsigned long long ino, size, blocks;
        unsigned int mode, nlink, uid, gid, first, count;
        long long at, mt, ct;
        int kind, file;
        double timeout;
        PyObject *target;
        int ok = PyArg_ParseTuple(t, "KiiIIIIKKLLLdSII", &ino, &kind, &file, &mode, &nlink, &uid, &gid, &size,
                                  &blocks, &at, &mt, &ct, &timeout, &target, &first, &count);
        if (ok) {
            nd->ino = ino;
            nd->kind = kind;
            nd->file = file;
            nd->st.st_ino = (ino_t)ino;
            nd->st.st_mode = mode;
            nd->st.st_nlink = nlink;
            nd->st.st_uid = uid;
            nd->st.st_gid = gid;
            nd->st.st_size = (off_t)size;
            nd->st.st_blksize = BLOCK; /* what O_DIRECT readers align to (llama.cpp): see fs.py */
            nd->st.st_blocks = (blkcnt_t)blocks;
            set_time(&nd->st.st_atim, at);
            set_time(&nd->st.st_mtim, mt);
            set_time(&nd->st.st_ctim, ct);
            nd->timeout = timeout;
            nd->target = dup_bytes(target);
            nd->target_len = (size_t)PyBytes_GET_SIZE(target);
            nd->first_child = first;
            nd->nchildren = count;
            ok = nd->target != NULL;
            if (ok && ((size_t)first + count > nchildren || (file >= 0 && (size_t)file >= e->nfiles) ||
                       (i > 0 && e->nodes[i - 1].ino >= ino))) {
                PyErr_SetString(PyExc_ValueError, "node table out of range or not sorted by inode");
                ok = 0;
            }
        }
        Py_DECREF(t);
        if (!ok)
            return -1;
        e->nnodes = (size_t)i + 1;
    }
    return 0;
}

static int load_children(engine_t *e, PyObject *children) {
    Py_ssize_t n = PySequence_Size(children);
    if (n < 0)
        return -1;
    e->children = calloc((size_t)n + 1, sizeof(child_t));
    if (!e->children) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_GetItem(children, i);
        if (!t)
            return -1;
        PyObject *name;
        unsigned long long ino;
        int ok = PyArg_ParseTuple(t, "SK", &name, &ino);
        if (ok) {
            e->children[i].name = dup_bytes(name);
            e->children[i].ino = ino;
            ok = e->children[i].name != NULL;
        }
        Py_DECREF(t);
        if (!ok)
            return -1;
        e->nchildren = (size_t)i + 1;
    }
    return 0;
}

/* (st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns): colifs.replicas.Identity. 0 on a Python error. */
static int parse_ident(PyObject *id, ident_t *out) {
    unsigned long long dev, ino, sz;
    long long mt, ct;
    if (!PyArg_ParseTuple(id, "KKKLL", &dev, &ino, &sz, &mt, &ct))
        return 0;
    *out = (ident_t){dev, ino, sz, mt, ct};
    return 1;
}

/* Each replica's identity of the file's copy at mount (what a reopened copy must still be). */
static int load_identities(engine_t *e, file_t *f, PyObject *idents) {
    if (PySequence_Size(idents) != e->nrep) {
        PyErr_SetString(PyExc_ValueError, "one identity per replica expected");
        return -1;
    }
    for (int d = 0; d < e->nrep; d++) {
        PyObject *id = PySequence_GetItem(idents, d);
        if (!id)
            return -1;
        ident_t got;
        int ok = parse_ident(id, &got);
        Py_DECREF(id);
        if (!ok)
            return -1;
        f->ident[d] = got;
    }
    return 0;
}

static void *copy_of(const char *src, size_t n, size_t spare) {
    void *p = malloc(n + spare);
    if (p)
        memcpy(p, src, n);
    return p;
}

/* Segment i starts after the one before it, inside the file, with a known key and rotation. */
static int segment_ok(const engine_t *e, const file_t *f, uint32_t i) {
    uint64_t at = f->seg_start[i];
    int ordered = i == 0 ? at == 0 : at > f->seg_start[i - 1];
    return ordered && at < f->size && f->seg_key[i] >= -1 && f->seg_key[i] < (int32_t)e->nkeys &&
           f->seg_rot[i] >= NOT_STRIPED && f->seg_rot[i] < STRIPE_SLOTS;
}

/* The run table (colifs.readplan.run_table): segment starts, keys, positions, rotations. */
static int load_segments(const engine_t *e, file_t *f, const char *const col[4], const Py_ssize_t len[4]) {
    uint32_t nseg = (uint32_t)(len[0] / 8);
    if (len[0] % 8 || len[1] != (Py_ssize_t)nseg * 4 || len[2] != (Py_ssize_t)nseg * 4 ||
        len[3] != (Py_ssize_t)nseg || (f->size && !nseg)) {
        PyErr_SetString(PyExc_ValueError, "run table sizes do not agree");
        return -1;
    }
    f->nseg = nseg;
    f->seg_start = copy_of(col[0], (size_t)len[0], 8);
    f->seg_key = copy_of(col[1], (size_t)len[1], 4);
    f->seg_pos = copy_of(col[2], (size_t)len[2], 4);
    f->seg_rot = copy_of(col[3], (size_t)len[3], 1);
    if (!f->seg_start || !f->seg_key || !f->seg_pos || !f->seg_rot) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < nseg; i++) {
        if (!segment_ok(e, f, i)) {
            PyErr_Format(PyExc_ValueError, "run table of %s: bad segment %u", f->relpath, i);
            return -1;
        }
    }
    return 0;
}

static int load_file(engine_t *e, file_t *f, PyObject *t) {
    PyObject *relpath, *idents;
    const char *col[4];
    Py_ssize_t len[4];
    unsigned long long size;
    unsigned int mask;
    if (!PyArg_ParseTuple(t, "SKIOy#y#y#y#", &relpath, &size, &mask, &idents, &col[0], &len[0], &col[1], &len[1],
                          &col[2], &len[2], &col[3], &len[3]))
        return -1;
    f->relpath = dup_bytes(relpath);
    if (!f->relpath)
        return -1;
    f->size = size;
    atomic_init(&f->mask, mask | 1u);
    pthread_mutex_init(&f->lock, NULL);
    pthread_cond_init(&f->opened, NULL);
    for (int d = 0; d < MAX_REPLICAS; d++)
        atomic_init(&f->fd[d], FD_CLOSED);
    return load_identities(e, f, idents) || load_segments(e, f, col, len) ? -1 : 0;
}

static int load_files(engine_t *e, PyObject *files) {
    Py_ssize_t n = PySequence_Size(files);
    if (n < 0)
        return -1;
    e->files = calloc((size_t)n + 1, sizeof(file_t));
    if (!e->files) {
        PyErr_NoMemory();
        return -1;
    }
    e->nfiles = (size_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_GetItem(files, i);
        if (!t)
            return -1;
        int r = load_file(e, &e->files[i], t);
        Py_DECREF(t);
        if (r)
            return -1;
    }
    return 0;
}

/* The counters, in the memory Python owns: the one statement of their layout, in order. Python
 * asks for it (counter_layout) and reads each field by name; `fill` and `passthrough` hold
 * the fields colifs.native names in FILLS and PASSTHROUGH (a test checks the widths). */
typedef enum { ONCE, PER_DRIVE, PER_KEY_AND_DRIVE, PER_KEY, PER_FILE } scale_t;

static const struct counter_field {
    const char *name;
    size_t at; /* where counters_t points to it */
    scale_t scale;
    size_t width; /* words per unit of the scale */
} COUNTERS[] = {
    {"drive_bytes", offsetof(counters_t, drive_bytes), PER_DRIVE, 1},
    {"drive_reads", offsetof(counters_t, drive_reads), PER_DRIVE, 1},
    {"drive_errors", offsetof(counters_t, drive_errors), PER_DRIVE, 1},
    {"drive_busy", offsetof(counters_t, drive_busy), PER_DRIVE, 1},
    {"drive_ok", offsetof(counters_t, drive_ok), PER_DRIVE, 1},
    {"drive_busy_ns", offsetof(counters_t, drive_busy_ns), PER_DRIVE, 1},
    {"drive_alone_ns", offsetof(counters_t, drive_alone_ns), PER_DRIVE, 1},
    {"drive_spilled", offsetof(counters_t, drive_spilled), PER_DRIVE, 1},
    {"fallbacks", offsetof(counters_t, fallbacks), ONCE, 2},
    {"fill", offsetof(counters_t, fill), ONCE, 21},
    {"passthrough", offsetof(counters_t, passthrough), ONCE, 5},
    {"key_bytes", offsetof(counters_t, key_bytes), PER_KEY_AND_DRIVE, 1},
    {"key_reads", offsetof(counters_t, key_reads), PER_KEY, 1},
    {"file_bytes", offsetof(counters_t, file_bytes), PER_FILE, 1},
    {"file_reads", offsetof(counters_t, file_reads), PER_FILE, 1},
};
#define NCOUNTERS (sizeof COUNTERS / sizeof *COUNTERS)

/* Per drive: MAX_REPLICAS slots whatever the replicas at mount, so that a mirror added while serving
 * (add_drive) moves no counter. */
static size_t counter_words(const struct counter_field *c, size_t nkeys, size_t nfiles) {
    size_t units[] = {[ONCE] = 1, [PER_DRIVE] = MAX_REPLICAS, [PER_KEY_AND_DRIVE] = nkeys * MAX_REPLICAS,
                      [PER_KEY] = nkeys, [PER_FILE] = nfiles};
    return c->width * units[c->scale];
}

static int map_counters(engine_t *e, Py_buffer *buf) {
    size_t words = 0;
    for (size_t i = 0; i < NCOUNTERS; i++)
        words += counter_words(&COUNTERS[i], e->nkeys, e->nfiles);
    if ((size_t)buf->len != words * 8 || ((uintptr_t)buf->buf % 8)) {
        PyErr_Format(PyExc_ValueError, "counters: %zu aligned bytes expected", words * 8);
        return -1;
    }
    memset(buf->buf, 0, words * 8);
    _Atomic uint64_t *p = buf->buf;
    for (size_t i = 0; i < NCOUNTERS; i++) {
        *(_Atomic uint64_t **)((char *)&e->ctr + COUNTERS[i].at) = p;
        p += counter_words(&COUNTERS[i], e->nkeys, e->nfiles);
    }
    return 0;
}

static PyObject *counter_layout(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t nkeys, nfiles;
    if (!PyArg_ParseTuple(args, "nn", &nkeys, &nfiles))
        return NULL;
    if (nkeys < 0 || nfiles < 0 || nkeys > (Py_ssize_t)1 << 40 || nfiles > (Py_ssize_t)1 << 40) {
        PyErr_SetString(PyExc_ValueError, "counter_layout: counts from 0 to 2^40");
        return NULL;
    }
    PyObject *out = PyList_New((Py_ssize_t)NCOUNTERS);
    for (size_t i = 0; out && i < NCOUNTERS; i++) {
        size_t n = counter_words(&COUNTERS[i], (size_t)nkeys, (size_t)nfiles);
        PyObject *item = Py_BuildValue("(sn)", COUNTERS[i].name, (Py_ssize_t)n);
        if (!item) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
    return out;
}

/* -- the type ---------------------------------------------------------------------------------- */

/* The callbacks: owned from here, whatever fails after (dealloc releases them, and a second
 * __init__ after a failed one the first one's). */
static void own_callbacks(EngineObject *self, PyObject *const calls[4]) {
    PyObject **owned[4] = {&self->control, &self->xattr, &self->listxattr, &self->event};
    for (int i = 0; i < 4; i++) {
        PyObject *old = *owned[i];
        Py_INCREF(calls[i]);
        *owned[i] = calls[i];
        Py_XDECREF(old);
    }
}

/* One byte per key, 1 for the routed experts (the keys fills work on). Releases `experts`. */
static int load_experts(engine_t *e, Py_buffer *experts, Py_ssize_t nkeys) {
    int bad = experts->buf && experts->len != nkeys;
    if (!bad && nkeys > 0) {
        e->key_expert = calloc((size_t)nkeys, 1);
        if (e->key_expert && experts->buf)
            memcpy(e->key_expert, experts->buf, (size_t)nkeys);
    }
    if (experts->buf)
        PyBuffer_Release(experts);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "expert_keys: one byte per key expected");
        return -1;
    }
    if (nkeys > 0 && !e->key_expert) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The replicas' roots and the routes in force (colifs.readplan.route_columns). */
static int load_replicas(engine_t *e, PyObject *roots, const uint8_t *routes, size_t route_len, int ok) {
    Py_ssize_t nrep = PySequence_Size(roots);
    if (nrep < 1 || nrep > MAX_REPLICAS || !ok) {
        PyErr_Format(PyExc_ValueError, "1 to %d replicas, and at least one thread of each kind", MAX_REPLICAS);
        return -1;
    }
    e->nrep = (int)nrep;
    e->ncols = 1 << (e->nrep - 1);
    pthread_mutex_init(&e->primary_act.m, NULL); /* a mirror's: its drive generation's (drives.c) */
    pthread_mutex_init(&e->waiting.m, NULL);
    if (!routes || set_routes(e, routes, route_len)) {
        PyErr_SetString(PyExc_ValueError, "routes: one valid column per set of mirrors expected");
        return -1;
    }
    for (int d = 0; d < e->nrep; d++) {
        PyObject *b = PySequence_GetItem(roots, d);
        e->roots[d] = b ? dup_bytes(b) : NULL;
        Py_XDECREF(b);
        if (!e->roots[d])
            return -1;
    }
    return 0;
}

/* The namespace, the files' run tables, the counters' memory and the extent buffer. */
static int load_tables(EngineObject *self, PyObject *files, PyObject *children, PyObject *nodes,
                       PyObject *counters, Py_ssize_t fill_mib) {
    engine_t *e = &self->e;
    if (load_files(e, files) || load_children(e, children) || load_nodes(e, nodes, e->nchildren))
        return -1;
    if (PyObject_GetBuffer(counters, &self->counters, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS))
        return -1;
    self->have_counters = 1;
    if (map_counters(e, &self->counters))
        return -1;
    if (fill_mib < 0 || fill_init(e, (size_t)fill_mib << 20) || views_init(e)) {
        PyErr_SetString(fill_mib < 0 ? PyExc_ValueError : PyExc_MemoryError, "fill_mib: not a budget");
        return -1;
    }
    for (size_t i = 0; i < e->nchildren; i++) {
        if (!engine_node(e, e->children[i].ino)) {
            PyErr_SetString(PyExc_ValueError, "a directory entry names an unknown inode");
            return -1;
        }
    }
    return 0;
}

static int new_session(engine_t *e, const char *opts) {
    struct fuse_args fa = FUSE_ARGS_INIT(0, NULL);
    if (fuse_opt_add_arg(&fa, "colifs") || fuse_opt_add_arg(&fa, "-o") || fuse_opt_add_arg(&fa, opts)) {
        PyErr_NoMemory();
        return -1;
    }
    e->se = fuse_session_new(&fa, &colifs_ops, sizeof colifs_ops, e);
    fuse_opt_free_args(&fa);
    if (!e->se) {
        PyErr_SetString(PyExc_RuntimeError, "fuse_session_new failed (bad options?)");
        return -1;
    }
    return 0;
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"mountpoint", "options", "roots", "direct", "fuse_threads", "drive_threads",
                            "mirror_timeout", "nodes", "children", "files", "nkeys", "counters", "control",
                            "xattr", "listxattr", "event", "routes", "expert_keys", "fill_mib",
                            "passthrough", "queue_routing", "direct_reads", NULL};
    const char *mnt, *opts;
    PyObject *roots, *nodes, *children, *files, *counters, *calls[4];
    int direct, fuse_threads, drive_threads;
    double timeout;
    Py_ssize_t nkeys;
    Py_ssize_t fill_mib = 0;
    int passthrough = 0, queue_routing = 0, direct_reads = 0;
    Py_buffer experts = {0}, routes = {0};
    if (self->e.nrep) {
        PyErr_SetString(PyExc_RuntimeError, "Engine is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "yyOpiidOOOnOOOOOy*|y*nipp", names, &mnt, &opts, &roots, &direct,
                                     &fuse_threads, &drive_threads, &timeout, &nodes, &children, &files,
                                     &nkeys, &counters, &calls[0], &calls[1], &calls[2], &calls[3], &routes,
                                     &experts, &fill_mib, &passthrough, &queue_routing, &direct_reads))
        return -1;
    own_callbacks(self, calls);
    uint8_t route_bytes[(1 << (MAX_REPLICAS - 1)) * (8 * MAX_REPLICAS + STRIPE_SLOTS)];
    size_t route_len = (size_t)routes.len;
    int routes_fit = route_len <= sizeof route_bytes;
    if (routes_fit)
        memcpy(route_bytes, routes.buf, route_len);
    PyBuffer_Release(&routes);
    engine_t *e = &self->e;
    if (load_experts(e, &experts, nkeys))
        return -1;
    int counts_ok = fuse_threads >= 1 && drive_threads >= 1 && nkeys >= 0;
    if (load_replicas(e, roots, routes_fit ? route_bytes : NULL, route_len, counts_ok))
        return -1;
    e->direct_io = direct;
    if (passthrough < PT_NEVER || passthrough > PT_ALWAYS) {
        PyErr_SetString(PyExc_ValueError, "passthrough: 0 never, 1 auto, 2 always");
        return -1;
    }
    e->passthrough = passthrough;
    e->queue_routing = queue_routing;
    e->direct_reads = direct_reads;
    e->fuse_threads = fuse_threads;
    e->drive_threads = drive_threads;
    e->mirror_timeout = timeout;
    e->nkeys = (size_t)nkeys;
    atomic_init(&e->up, (1u << e->nrep) - 1);
    e->mountpoint = strdup(mnt);
    e->py = self;
    e->control = py_control;
    e->xattr = py_xattr;
    e->listxattr = py_listxattr;
    e->event = py_event;
    if (load_tables(self, files, children, nodes, counters, fill_mib))
        return -1;
    return new_session(e, opts);
}

static PyObject *Engine_mount(EngineObject *self, PyObject *unused) {
    (void)unused;
    engine_t *e = &self->e;
    if (!e->se || self->mounted) {
        PyErr_SetString(PyExc_RuntimeError, "not initialised, or mounted already");
        return NULL;
    }
    int res;
    Py_BEGIN_ALLOW_THREADS res = fuse_session_mount(e->se, e->mountpoint);
    Py_END_ALLOW_THREADS if (res != 0) {
        PyErr_Format(PyExc_RuntimeError, "fuse_session_mount on %s failed", e->mountpoint);
        return NULL;
    }
    self->mounted = 1;
    if ((e->passthrough != PT_NEVER || e->direct_reads) && (res = passthrough_setup(e)) != 0) {
        errno = res;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* The drives' threads take no signals: those are the main thread's (Python handles them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err = drives_start(e);
    if (!err)
        err = fills_start(e);
    if (!err)
        err = views_start(e);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_loop(EngineObject *self, PyObject *unused) {
    (void)unused;
    engine_t *e = &self->e;
    if (!self->mounted || self->destroyed) {
        PyErr_SetString(PyExc_RuntimeError, "not mounted");
        return NULL;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = wake; /* no SA_RESTART: the loop's sem_wait returns and sees the exit flag */
    sigaction(WAKE_SIGNAL, &sa, NULL);
    int res;
    Py_BEGIN_ALLOW_THREADS;
    /* This thread and the FUSE threads it starts take only the wake signal. */
    sigset_t mask;
    sigfillset(&mask);
    sigdelset(&mask, WAKE_SIGNAL);
    pthread_sigmask(SIG_SETMASK, &mask, NULL);
    e->loop_thread = pthread_self();
    atomic_store(&e->looping, 1);
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_clone_fd(cfg, 1);
    fuse_loop_cfg_set_max_threads(cfg, (unsigned)e->fuse_threads);
    fuse_loop_cfg_set_idle_threads(cfg, (unsigned)e->fuse_threads);
    res = fuse_session_loop_mt(e->se, cfg);
    fuse_loop_cfg_destroy(cfg);
    atomic_store(&e->looping, 0);
    Py_END_ALLOW_THREADS;
    return PyLong_FromLong(res);
}

static PyObject *Engine_stop(EngineObject *self, PyObject *unused) {
    (void)unused;
    engine_t *e = &self->e;
    Py_BEGIN_ALLOW_THREADS;
    fill_quiesce(e);
    Py_END_ALLOW_THREADS;
    if (e->se)
        fuse_session_exit(e->se);
    if (atomic_load(&e->looping))
        pthread_kill(e->loop_thread, WAKE_SIGNAL);
    Py_RETURN_NONE;
}

static PyObject *Engine_set_up(EngineObject *self, PyObject *args) {
    int drive, up;
    if (!PyArg_ParseTuple(args, "ip", &drive, &up))
        return NULL;
    if (drive < 1 || drive >= self->e.nrep) {
        PyErr_SetString(PyExc_ValueError, "no such mirror");
        return NULL;
    }
    if (up) {
        /* Back up: its copies' descriptors may be dead (its filesystem remounted, a USB re-plug, a
         * restarted FUSE mirror) while the check read opened a fresh one: open them again. */
        if (!(atomic_fetch_or(&self->e.up, 1u << drive) & (1u << drive)))
            atomic_fetch_add(&self->e.epoch[drive], 1);
    } else
        atomic_fetch_and(&self->e.up, ~(1u << drive));
    Py_RETURN_NONE;
}

/* set_copy(file, drive, identity or None): a reload's verdict on one mirror copy (False: the file
 * holds too many retired descriptors now; ask again once its reads are done). */
static PyObject *Engine_set_copy(EngineObject *self, PyObject *args) {
    unsigned int file;
    int drive;
    PyObject *id;
    if (!PyArg_ParseTuple(args, "IiO", &file, &drive, &id))
        return NULL;
    if (drive < 1 || drive >= self->e.nrep || file >= self->e.nfiles) {
        PyErr_SetString(PyExc_ValueError, "no such mirror or file");
        return NULL;
    }
    ident_t ident;
    if (id != Py_None && !parse_ident(id, &ident))
        return NULL;
    int err;
    /* It waits for the file's lock, which a primary open holds while it may call into Python. */
    Py_BEGIN_ALLOW_THREADS
    err = file_set_copy(&self->e.files[file], drive, id == Py_None ? NULL : &ident);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(err == 0);
}

/* add_drive(root, routes): one more mirror while serving (colifs mirror add), drive nrep: its
 * threads started, then the routes for the new count in force. No file has a copy on it yet. */
static PyObject *Engine_add_drive(EngineObject *self, PyObject *args) {
    PyObject *root;
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "Oy*", &root, &b))
        return NULL;
    engine_t *e = &self->e;
    int d = atomic_load(&e->nrep);
    char *s = d >= 1 && d < MAX_REPLICAS && self->mounted && !self->destroyed ? dup_bytes(root) : NULL;
    if (!s) {
        PyBuffer_Release(&b);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "a mounted engine serves at most %d replicas", MAX_REPLICAS);
        return NULL;
    }
    atomic_store(&e->roots[d], s);
    /* The drives' threads take no signals: those are the main thread's (Python handles them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int err;
    Py_BEGIN_ALLOW_THREADS /* the fills' lock may be held by a thread that calls into Python */
    err = add_drive(e, b.buf, (size_t)b.len);
    if (!err)
        fill_drive_start(e, d); /* if its threads could not start, fills read its pieces from the primary */
    Py_END_ALLOW_THREADS
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    PyBuffer_Release(&b);
    if (err)  /* nothing started, or what was is stopped */
        free(atomic_exchange(&e->roots[d], NULL));
    if (err < 0) {
        PyErr_SetString(PyExc_ValueError, "routes: one valid column per set of mirrors expected");
        return NULL;
    }
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* A new root string for a slot, with room to keep the old one (a generation reading it may still
 * build a path from it, until the engine is freed); NULL on a Python error. */
static char *new_root(EngineObject *self, PyObject *root) {
    char **grown = realloc(self->old_roots, (self->nold_roots + 1) * sizeof *grown);
    if (!grown) {
        PyErr_NoMemory();
        return NULL;
    }
    self->old_roots = grown;
    return dup_bytes(root);
}

/* renew_drive(drive, root or None): the mirror slot gets a new generation, with threads, queue and
 * counts of its own, reading `root` (None: the same directory); the one in force is retired (its
 * calls under way finish against it) and its number returned, for calls(). Python calls it once
 * every copy on the drive is out (colifs mirror remove), and when another directory takes a
 * removed mirror's place (colifs mirror add). */
static PyObject *Engine_renew_drive(EngineObject *self, PyObject *args) {
    int drive;
    PyObject *root;
    if (!PyArg_ParseTuple(args, "iO", &drive, &root))
        return NULL;
    if (drive < 1 || drive >= self->e.nrep || !self->mounted || self->destroyed ||
        !atomic_load(&self->e.drives[drive])) {
        PyErr_SetString(PyExc_ValueError, "no such mirror serving");
        return NULL;
    }
    char *s = root == Py_None ? NULL : new_root(self, root);
    if (root != Py_None && !s)
        return NULL;
    /* The drives' threads take no signals: those are the main thread's (Python handles them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    uint32_t retired = 0;
    int err;
    /* Without the GIL: the fills' lock may be held by a thread that calls into Python. (What may
     * wait on the hung drive, ending the jobs it still queues, runs on a thread of its own.) */
    Py_BEGIN_ALLOW_THREADS
    err = drive_renew(&self->e, drive, s, &retired);
    if (!err)
        fill_drive_renew(&self->e, drive); /* if its readers could not start, the primary reads its pieces */
    Py_END_ALLOW_THREADS
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err) {
        free(s);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (s)
        self->old_roots[self->nold_roots++] = atomic_exchange(&self->e.roots[drive], s);
    return PyLong_FromUnsignedLong(retired);
}

/* calls(drive, generation): threads inside an open, read, fstat or close on that generation of the
 * mirror slot now (0 once all returned, or for a generation it never had). */
static PyObject *Engine_calls(EngineObject *self, PyObject *args) {
    int drive;
    unsigned int number;
    if (!PyArg_ParseTuple(args, "iI", &drive, &number))
        return NULL;
    if (drive < 1 || drive >= self->e.nrep) {
        PyErr_SetString(PyExc_ValueError, "no such mirror");
        return NULL;
    }
    return PyLong_FromLong(drive_calls(&self->e, drive, number));
}

static PyObject *Engine_set_routes(EngineObject *self, PyObject *args) {
    Py_buffer b;
    if (!PyArg_ParseTuple(args, "y*", &b))
        return NULL;
    int bad = !self->e.nrep || set_routes(&self->e, b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "routes: one valid column per set of mirrors expected");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_set_speeds(EngineObject *self, PyObject *args) {
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "O", &seq))
        return NULL;
    Py_ssize_t n = PySequence_Size(seq);
    if (!self->e.nrep || n != self->e.nrep) {
        PyErr_SetString(PyExc_ValueError, "speeds: one per replica (bytes/s, 0: not known)");
        return NULL;
    }
    uint64_t speed[MAX_REPLICAS];
    for (Py_ssize_t d = 0; d < n; d++) { /* every one checked before any is stored */
        PyObject *v = PySequence_GetItem(seq, d);
        speed[d] = v ? PyLong_AsUnsignedLongLong(v) : 0;
        Py_XDECREF(v);
        if (PyErr_Occurred())
            return NULL;
    }
    for (Py_ssize_t d = 0; d < n; d++)
        atomic_store_explicit(&self->e.speed[d], speed[d], memory_order_relaxed);
    Py_RETURN_NONE;
}

static PyObject *Engine_set_passthrough_allowed(EngineObject *self, PyObject *args) {
    int allowed;
    if (!PyArg_ParseTuple(args, "p", &allowed))
        return NULL;
    atomic_store(&self->e.pt_allow, allowed);
    Py_RETURN_NONE;
}

static PyObject *Engine_set_memory_short(EngineObject *self, PyObject *args) {
    int is_short;
    if (!PyArg_ParseTuple(args, "p", &is_short))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
    fill_pause(&self->e, is_short);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* Unmount (lazily: the kernel detaches it now and lets open files drain) and free the session.
 * Call once the loop has returned. */
static PyObject *Engine_close(EngineObject *self, PyObject *unused) {
    (void)unused;
    engine_t *e = &self->e;
    if (atomic_load(&e->looping)) {
        PyErr_SetString(PyExc_RuntimeError, "the loop is still running");
        return NULL;
    }
    if (self->destroyed || !e->se) /* closed already, or never initialised */
        Py_RETURN_NONE;
    self->destroyed = 1;
    Py_BEGIN_ALLOW_THREADS;
    drives_stop(e);
    fills_stop(e);
    if (self->mounted)
        fuse_session_unmount(e->se);
    fuse_session_destroy(e->se);
    views_stop(e);
    Py_END_ALLOW_THREADS;
    e->se = NULL;
    Py_RETURN_NONE;
}

/* No thread of ours runs, or can: never mounted (threads start with the mount), or closed with no
 * drive thread left stuck in a read. Until then a thread may use the engine and call into Python. */
static int quiescent(EngineObject *self) {
    return (self->destroyed || !self->mounted) && !self->e.threads_left && !atomic_load(&self->e.looping);
}

/* The callbacks are bound methods of the NativeEngine that holds this object: a cycle only the
 * garbage collector can break. */
static int Engine_traverse(EngineObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->control);
    Py_VISIT(self->xattr);
    Py_VISIT(self->listxattr);
    Py_VISIT(self->event);
    return 0;
}

static int Engine_clear(EngineObject *self) {
    if (!quiescent(self)) /* a thread may still call them: kept (the collector breaks the cycle at the
                             holder's attributes instead; this object then stays allocated) */
        return 0;
    Py_CLEAR(self->control);
    Py_CLEAR(self->xattr);
    Py_CLEAR(self->listxattr);
    Py_CLEAR(self->event);
    return 0;
}

static void Engine_dealloc(EngineObject *self) {
    PyObject_GC_UnTrack(self);
    /* If a thread may still run (the session never closed, or a drive thread left stuck in a read
     * on a hung mirror: a late job still releases its file and counts its bytes when its read
     * returns), the engine lives in this object: it is left allocated, callbacks and all. */
    if (!quiescent(self))
        return;
    engine_t *e = &self->e;
    if (e->se && !self->destroyed)
        fuse_session_destroy(e->se); /* made, never mounted */
    for (size_t i = 0; i < e->nfiles; i++) {
        free(e->files[i].relpath);
        free(e->files[i].seg_start);
        free(e->files[i].seg_key);
        free(e->files[i].seg_pos);
        free(e->files[i].seg_rot);
        free(e->files[i].expert_seg);
        free(e->files[i].mpath);
        for (int d = 0; d < MAX_REPLICAS; d++)
            free(e->files[i].changed_why[d]);
    }
    for (size_t i = 0; i < e->nnodes; i++)
        free(e->nodes[i].target);
    for (size_t i = 0; i < e->nchildren; i++)
        free(e->children[i].name);
    free(e->files);
    free(e->nodes);
    free(e->children);
    free(e->key_expert);
    drives_free(e);
    fill_free_arena(e);
    if (self->have_counters)
        PyBuffer_Release(&self->counters);
    for (int d = 0; d < e->nrep; d++)
        free(e->roots[d]);
    for (size_t i = 0; i < self->nold_roots; i++)
        free(self->old_roots[i]);
    free(self->old_roots);
    free(e->mountpoint);
    Engine_clear(self); /* the callbacks: quiescent, so it lets them go */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Engine_methods[] = {
    {"mount", (PyCFunction)Engine_mount, METH_NOARGS, "Mount (the session was made by the constructor)."},
    {"loop", (PyCFunction)Engine_loop, METH_NOARGS, "Serve until unmounted or stopped (releases the GIL)."},
    {"stop", (PyCFunction)Engine_stop, METH_NOARGS, "Make loop() return (from any thread)."},
    {"set_up", (PyCFunction)Engine_set_up, METH_VARARGS, "set_up(drive, up): route to a mirror or not."},
    {"set_speeds", (PyCFunction)Engine_set_speeds, METH_VARARGS,
     "set_speeds(speeds): bytes/s each drive delivered lately (0: not known), for --routing queue."},
    {"set_copy", (PyCFunction)Engine_set_copy, METH_VARARGS,
     "set_copy(file, drive, identity or None): a reload's verdict on a mirror copy (False: busy, "
     "ask again)."},
    {"add_drive", (PyCFunction)Engine_add_drive, METH_VARARGS,
     "add_drive(root, routes): one more mirror while serving (no copy on it yet); routes for the new count."},
    {"renew_drive", (PyCFunction)Engine_renew_drive, METH_VARARGS,
     "renew_drive(drive, root or None): the mirror slot's generation in force retired (its calls "
     "finish against it), a new one reading root; the retired one's number."},
    {"calls", (PyCFunction)Engine_calls, METH_VARARGS,
     "calls(drive, generation): threads inside a call on that generation of the mirror slot now."},
    {"set_routes", (PyCFunction)Engine_set_routes, METH_VARARGS,
     "set_routes(routes): the weights in force (colifs.readplan.route_columns), for the next requests."},
    {"set_passthrough_allowed", (PyCFunction)Engine_set_passthrough_allowed, METH_VARARGS,
     "set_passthrough_allowed(allowed): with passthrough auto, whether the page-cache opens of a file "
     "no mirror holds pass through (from the next open of a file not open)."},
    {"set_memory_short", (PyCFunction)Engine_set_memory_short, METH_VARARGS,
     "set_memory_short(short): pause (or resume) new fills."},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "Unmount and free the session (after loop())."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "colifs._native.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The native FUSE engine of colifs: tables in, requests served.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_traverse = (traverseproc)Engine_traverse,
    .tp_clear = (inquiry)Engine_clear,
    .tp_methods = Engine_methods,
};

static PyMethodDef module_functions[] = {
    {"counter_layout", counter_layout, METH_VARARGS,
     "counter_layout(nkeys, nfiles): [(name, words)] of the counters' memory, in order (per drive: "
     "MAX_REPLICAS)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "colifs' native FUSE engine.", -1,
                                    module_functions, NULL, NULL, NULL, NULL};

/* What Python passes or reads that C defines: one place each (tests compare them with Python's). */
static int add_constants(PyObject *m) {
    PyObject *kinds = Py_BuildValue("{sisisisisi}", "dir", NODE_DIR, "reg", NODE_REG, "lnk", NODE_LNK,
                                    "control_dir", NODE_CONTROL_DIR, "control_file", NODE_CONTROL_FILE);
    if (!kinds || PyModule_AddObject(m, "NODE_KINDS", kinds) < 0) {
        Py_XDECREF(kinds);
        return -1;
    }
    static const struct {
        const char *name;
        int value;
    } ints[] = {
        {"MAX_REPLICAS", MAX_REPLICAS},
        {"STRIPE_SLOTS", STRIPE_SLOTS},
        {"NOT_STRIPED", NOT_STRIPED},
        {"CHUNK", CHUNK},
        {"EV_MIRROR_FAILED", EV_MIRROR_FAILED},
        {"EV_MIRROR_CHANGED", EV_MIRROR_CHANGED},
        {"EV_PRIMARY_FAILED", EV_PRIMARY_FAILED},
        {"EV_NO_DIRECT", EV_NO_DIRECT},
        {"EV_NO_FDS", EV_NO_FDS},
        {"EV_NO_PASSTHROUGH", EV_NO_PASSTHROUGH},
        {"EV_PRIMARY_CHANGED", EV_PRIMARY_CHANGED},
        {"EV_NO_DIRECT_READS", EV_NO_DIRECT_READS},
    };
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++)
        if (PyModule_AddIntConstant(m, ints[i].name, ints[i].value) < 0)
            return -1;
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&EngineType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0 || add_constants(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
