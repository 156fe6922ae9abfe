/* The read path: a request is cut into runs by the file's run table, the runs on mirrors are
 * handed to their drives' threads while the primary's runs are read inline, and whatever a mirror
 * failed is re-read from the primary. The bytes returned are always the primary's: a mirror run
 * counts only when it read in full and the copy is unchanged after the read.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

typedef struct pending pending_t;

typedef struct job {
    pending_t *p;
    file_t *f;
    int drive, run;
    char *dst;
    uint64_t off;
    size_t len;
    ssize_t got; /* -1: error (err) */
    int err, changed, opened_failed, done;
    int no_fds; /* the open failed for want of descriptors: the daemon's lack, not the mirror's */
    ident_t want;  /* the copy's identity, generation and use when the job was handed out */
    uint32_t gen;
    drive_t *dg;   /* the drive's generation in force then: its directory, its calls, its queue */
    int usable;    /* 0: a reload took the copy out after the request was planned: not read */
    int waited;    /* counted in waiting.pending until done or given up on (under p->m) */
    int via_cache; /* a read call's: through the drive's page cache (reading_t) */
    char what[200];
    struct job *next;
} job_t;

/* One reading's mirror jobs. Freed by whoever drops the last reference: the reading, or, when it
 * gave up waiting (timeout), the last job to finish, which then calls `release` (the memory the
 * late jobs wrote into is free to go). */
struct pending {
    pthread_mutex_t m;
    pthread_cond_t c;
    int left, refs, abandoned;
    void (*release)(void *arg);
    void *arg;
    job_t jobs[];
};

static void note(notes_t *nt, int kind, int drive, int timed_out, uint32_t gen, const char *what);

/* A call into drive generation g's filesystem (NULL: the primary's, not counted) is counted while
 * it runs: `colifs mirror remove` waits for them, as a thread stuck in one holds the drive busy. */
static void call_begin(drive_t *g) {
    if (g)
        atomic_fetch_add(&g->in_calls, 1);
}

static void call_end(drive_t *g) {
    if (g)
        atomic_fetch_sub(&g->in_calls, 1);
}

/* Buffered twins of the drives' O_DIRECT descriptors, for read calls (pread_via_cache): twins[fd] is
 * the twin of descriptor fd, plus 1 (0: none yet). Opened at a read call's first read of fd, closed
 * just before fd (close_on: every descriptor a reader may hold is closed there, once none can read
 * it), so a twin lives as long as its descriptor and is found by its number. Process-wide, as
 * descriptor numbers are. */
static _Atomic int *twins;
static size_t ntwins;
static pthread_once_t twins_once = PTHREAD_ONCE_INIT;

static void make_twins(void) {
    struct rlimit r;
    size_t n = getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur != RLIM_INFINITY ? (size_t)r.rlim_cur : 0;
    n = n > (1u << 20) ? 1u << 20 : n;
    twins = n ? calloc(n, sizeof *twins) : NULL;
    ntwins = twins ? n : 0;
}

static void close_twin(int fd) {
    pthread_once(&twins_once, make_twins); /* the table is made once, and seen made, before use */
    if (fd >= 0 && (size_t)fd < ntwins) {
        int t = atomic_exchange(&twins[fd], 0);
        if (t)
            close(t - 1);
    }
}

static void close_on(drive_t *g, int fd) {
    call_begin(g);
    close_twin(fd);
    close(fd);
    call_end(g);
}

static __thread char *thread_buf; /* REQ_BUF bytes, page-aligned, one per FUSE thread */
static pthread_key_t buf_key;
static pthread_once_t buf_once = PTHREAD_ONCE_INIT;

static void free_buf(void *p) { free(p); }
static void make_key(void) { pthread_key_create(&buf_key, free_buf); }

static char *aligned(size_t n) {
    void *p = NULL;
    return posix_memalign(&p, BLOCK, n) == 0 ? p : NULL;
}

static char *request_buffer(size_t n) {
    if (n > REQ_BUF)
        return aligned(n);
    if (!thread_buf) {
        pthread_once(&buf_once, make_key);
        thread_buf = aligned(REQ_BUF);
        pthread_setspecific(buf_key, thread_buf);
    }
    return thread_buf;
}

/* The thread's buffer now belongs to a request that gave up on a read still writing into it. */
static void lose_thread_buffer(char *buf) {
    if (buf == thread_buf) {
        thread_buf = NULL;
        pthread_setspecific(buf_key, NULL);
    }
}

static void done_with(char *buf) {
    if (buf != thread_buf)
        free(buf);
}

/* Fill [off, off+len) from fd; fewer bytes only at the end of the file. -1 on error (errno). */
static ssize_t pread_full(int fd, char *dst, size_t len, uint64_t off, int direct) {
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, dst + got, len - got, (off_t)(off + got));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        got += (size_t)n;
        if (n == 0 || (direct && n % BLOCK))
            break; /* end of file (an O_DIRECT read is short only there) */
    }
    return (ssize_t)got;
}

/* fd opened again without O_DIRECT (/proc/self/fd: the same inode whatever its path is now), or -1. */
static int reopen_buffered(int fd) {
    char path[32];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int t = open(path, O_RDONLY | O_CLOEXEC);
    if (t >= 0) /* no readahead: one twin serves every reader of the file at once, each read is what a
                   call or a fill asked for (a readahead state they all share kept the drives busy
                   with reads nobody asked for, runs 81e-81h) */
        posix_fadvise(t, 0, 0, POSIX_FADV_RANDOM);
    return t;
}

/* Whether two descriptors are of one file. */
static int same_file(int a, int b) {
    struct stat x, y;
    return fstat(a, &x) == 0 && fstat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* fd's twin, opened now if it has none yet (the caller's hold on fd keeps both open); -1 if it can
 * have none (no table, no descriptor left). A twin of another file, which only a close that missed
 * close_on could leave, is never read from: it is closed and replaced. */
static int twin_of(int fd) {
    pthread_once(&twins_once, make_twins);
    if (fd < 0 || (size_t)fd >= ntwins)
        return -1;
    int t = atomic_load(&twins[fd]);
    if (t && same_file(fd, t - 1))
        return t - 1;
    if (t && atomic_compare_exchange_strong(&twins[fd], &t, 0))
        close(t - 1); /* of another file: gone, and fd gets its own */
    t = 0;
    int fresh = reopen_buffered(fd);
    if (fresh < 0)
        return -1;
    if (atomic_compare_exchange_strong(&twins[fd], &t, fresh + 1))
        return fresh;
    close(fresh); /* another reader's came first */
    return t - 1;
}

/* pread_full, for a read call (direct_reads, fs.c) through the drive's page cache: the mount's
 * page cache keeps no read call's bytes, the drive's keeps them for the next call. From an
 * O_DIRECT descriptor, through its twin (O_DIRECT if it can have none). */
static ssize_t pread_via_cache(int fd, char *dst, size_t len, uint64_t off, int direct) {
    int twin = direct ? twin_of(fd) : -1;
    return twin >= 0 ? pread_full(twin, dst, len, off, 0) : pread_full(fd, dst, len, off, direct);
}

static ssize_t pread_as(int fd, char *dst, size_t len, uint64_t off, int direct, int via_cache) {
    return via_cache ? pread_via_cache(fd, dst, len, off, direct) : pread_full(fd, dst, len, off, direct);
}

static int same_identity(int fd, const ident_t *want, char *what, size_t n) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(what, n, "fstat: %s", strerror(errno));
        return 0;
    }
    int64_t mtime = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    int64_t ctime = (int64_t)st.st_ctim.tv_sec * 1000000000 + st.st_ctim.tv_nsec;
    if ((uint64_t)st.st_dev == want->dev && (uint64_t)st.st_ino == want->ino &&
        (uint64_t)st.st_size == want->size && mtime == want->mtime_ns && ctime == want->ctime_ns)
        return 1;
    snprintf(what, n,
             "device %llu -> %llu, inode %llu -> %llu, size %llu -> %llu, mtime %lld -> %lld, ctime %lld -> %lld",
             (unsigned long long)want->dev, (unsigned long long)st.st_dev,
             (unsigned long long)want->ino, (unsigned long long)st.st_ino,
             (unsigned long long)want->size, (unsigned long long)st.st_size,
             (long long)want->mtime_ns, (long long)mtime, (long long)want->ctime_ns, (long long)ctime);
    return 0;
}

int open_backing(engine_t *e, int drive, const char *root, const char *relpath, int *direct) {
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/%s", root, relpath) >= (int)sizeof path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    *direct = 0;
    if (e->direct_io) {
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (fd >= 0) {
            *direct = 1;
            return fd;
        }
        if (errno != EINVAL)
            return -1;
        uint32_t bit = 1u << drive;
        if (!(atomic_fetch_or(&e->no_direct_warned, bit) & bit))
            e->event(e->py, EV_NO_DIRECT, drive, -1, path, 0, 0, 0);
    }
    return open(path, O_RDONLY | O_CLOEXEC);
}

int file_open(engine_t *e, file_t *f) {
    notes_t nt = {.n = 0};
    pthread_mutex_lock(&f->lock);
    int err = file_open_locked(e, f, &nt);
    pthread_mutex_unlock(&f->lock);
    send_notes(e, f, &nt);
    return err;
}

/* The primary's open holds the file's lock: it runs only when nothing holds the file (refs == 0: no
 * open, no job, no fill), so only other opens of the file wait, and they need this descriptor.
 * It must find the file mounted (ident[0]): a file replaced since (an `hf download`, an rsync) has
 * other headers and other bytes than the run table and the mirrors' copies, and serving it would
 * mix them. It is refused (EIO) instead, until a remount; opens that hold the old file read on. */
int file_open_locked(engine_t *e, file_t *f, notes_t *nt) {
    int err = 0;
    if (f->refs == 0) {
        int direct;
        char what[200];
        int fd = open_backing(e, 0, e->roots[0], f->relpath, &direct);
        if (fd < 0) {
            err = errno;
        } else if (f->ident[0].ino && !same_identity(fd, &f->ident[0], what, sizeof what)) { /* 0: not known */
            close(fd);
            err = EIO;
            if (!atomic_exchange(&f->primary_changed, 1))
                note(nt, EV_PRIMARY_CHANGED, 0, 0, 0, what);
        } else {
            atomic_store(&f->fd[0], fd);
            f->direct[0] = direct;
        }
    }
    if (!err)
        f->refs++;
    return err;
}

/* Descriptors taken out of a file under its lock, closed once it is dropped: a close can block
 * (a FUSE or NFS mirror's flush) and every open of the file waits for the lock. Nobody holds
 * their numbers any more, and they stay taken until closed, so no open reuses one meanwhile. */
typedef struct {
    int fd[MAX_REPLICAS + RETIRED_SLOTS];
    drive_t *on[MAX_REPLICAS + RETIRED_SLOTS]; /* the generation each was opened on (its calls) */
    int n;
} closing_t;

static void closing_add(closing_t *c, int fd, drive_t *on) {
    c->on[c->n] = on;
    c->fd[c->n++] = fd;
}

/* Whether retired descriptor i is of the copy in force (f->lock held). */
static int current_locked(const file_t *f, int i) {
    return f->retired_gen[i] == atomic_load(&f->copy_gen[f->retired_on[i]]);
}

/* Whether retired descriptor i can be closed: no job of its copy generation runs (f->lock held). */
static int unread_locked(const file_t *f, int i) {
    return current_locked(f, i) ? f->jobs[f->retired_on[i]] == 0 : f->retired_readers[i] == 0;
}

/* The retired descriptors of drive d that no job can read any more (d < 0: every one, when the file
 * is released and no job holds it) move to c; f->lock held. */
static void take_retired_locked(file_t *f, closing_t *c, int d) {
    int kept = 0;
    for (int i = 0; i < f->nretired; i++) {
        if (d < 0 || (f->retired_on[i] == d && unread_locked(f, i))) {
            closing_add(c, f->retired[i], f->retired_drive[i]);
        } else {
            f->retired[kept] = f->retired[i];
            f->retired_on[kept] = f->retired_on[i];
            f->retired_gen[kept] = f->retired_gen[i];
            f->retired_readers[kept] = f->retired_readers[i];
            f->retired_drive[kept++] = f->retired_drive[i];
        }
    }
    f->nretired = kept;
}

/* fd, drive d's descriptor of the copy in force, retired (f->lock held; room checked). */
static void retire_locked(file_t *f, int d, int fd) {
    int i = f->nretired++;
    f->retired_on[i] = (uint8_t)d;
    f->retired[i] = fd;
    f->retired_gen[i] = atomic_load(&f->copy_gen[d]);
    f->retired_readers[i] = 0;
    f->retired_drive[i] = f->fd_drive[d];
}

/* Retired descriptors of the copies in force (f->lock held): at most RETIRED_FDS of them. */
static int retired_current_locked(const file_t *f) {
    int n = 0;
    for (int i = 0; i < f->nretired; i++)
        n += current_locked(f, i);
    return n;
}

static void close_taken(closing_t *c) {
    for (int i = 0; i < c->n; i++)
        close_on(c->on[i], c->fd[i]);
}

void file_release(engine_t *e, file_t *f) {
    closing_t c = {.n = 0};
    pthread_mutex_lock(&f->lock);
    if (--f->refs == 0) {
        for (int d = 0; d < e->nrep; d++) {
            int fd = atomic_exchange(&f->fd[d], FD_CLOSED);
            if (fd >= 0)
                closing_add(&c, fd, d ? f->fd_drive[d] : NULL);
        }
        take_retired_locked(f, &c, -1);
    }
    pthread_mutex_unlock(&f->lock);
    close_taken(&c);
}

/* A mirror job on f and drive d, of copy generation gen, is over: the descriptors of its copy
 * retired meanwhile close once no job of that copy can read them (every job that may hold one was
 * counted before it was queued), then its hold on f ends. */
static void job_done(engine_t *e, file_t *f, int d, uint32_t gen) {
    closing_t c = {.n = 0};
    pthread_mutex_lock(&f->lock);
    if (gen == atomic_load(&f->copy_gen[d])) {
        f->jobs[d]--;
    } else { /* an older copy's: file_set_copy left its count with that copy's descriptors */
        for (int i = 0; i < f->nretired; i++)
            f->retired_readers[i] -= f->retired_on[i] == d && f->retired_gen[i] == gen;
    }
    take_retired_locked(f, &c, d);
    pthread_mutex_unlock(&f->lock);
    close_taken(&c);
    file_release(e, f);
}

/* A descriptor (or failed open) from before the mirror last came back up, f->lock held: retired
 * (closed once no job runs: jobs may still read it) so that the copy is opened again.
 * Returns the descriptor to use now: FD_CLOSED to open again, or the old one when too many were
 * retired already. */
static int renew_locked(engine_t *e, file_t *f, int d, int fd) {
    uint32_t now = atomic_load(&e->epoch[d]);
    if ((fd < 0 && fd != FD_FAILED) || atomic_load(&f->fd_epoch[d]) == now)
        return fd;
    if (fd >= 0 && (retired_current_locked(f) == RETIRED_FDS || f->nretired == RETIRED_SLOTS)) {
        atomic_store(&f->fd_epoch[d], now); /* keep it: a flapping drive must not exhaust descriptors */
        return fd;
    }
    if (fd >= 0)
        retire_locked(f, d, fd);
    atomic_store(&f->fd[d], FD_CLOSED);
    return FD_CLOSED;
}

/* What mirror_fd opened (or failed to), stored for the file's next jobs; unless a reload changed
 * the copy meanwhile: then it is closed and nothing is stored (fd[d] is the new copy's now, maybe
 * being opened by one of its jobs), and the job's piece is read from the primary (stale). */
static int opened(job_t *j, int fd, int direct, uint32_t epoch, uint32_t gen) {
    file_t *f = j->f;
    int d = j->drive;
    pthread_mutex_lock(&f->lock);
    int late = atomic_load(&f->copy_gen[d]) != gen;
    int closing = late ? fd : -1;
    if (late) {
        j->changed = 1; /* judged stale: the generation moved */
    } else {
        if (fd >= 0) {
            f->direct[d] = direct;
            f->fd_drive[d] = j->dg;
        } else {
            fd = j->changed ? FD_CHANGED : j->no_fds ? FD_CLOSED : FD_FAILED; /* no fds: tried again later */
        }
        if (fd == FD_CHANGED) {
            free(f->changed_why[d]);
            f->changed_why[d] = strdup(j->what);
        }
        atomic_store(&f->fd_epoch[d], epoch);
        atomic_store(&f->fd[d], fd);
    }
    pthread_cond_broadcast(&f->opened);
    pthread_mutex_unlock(&f->lock);
    if (closing >= 0)
        close_on(j->dg, closing);
    return late ? -1 : fd;
}

/* The copy's mask and identity as a reload says (f->lock held). */
static void set_verdict_locked(file_t *f, int d, const ident_t *ident) {
    uint32_t bit = 1u << d;
    if (ident) {
        f->ident[d] = *ident;
        atomic_fetch_or(&f->mask, bit);
    } else {
        atomic_fetch_and(&f->mask, ~bit);
    }
    atomic_fetch_add(&f->copy_gen[d], 1);
    atomic_fetch_and(&f->dropped, ~bit);
}

/* The copy in force on drive d becomes an older one (f->lock held, before copy_gen moves): its
 * descriptor retires, or closes into c when none of its jobs runs; its jobs' count goes with its
 * retired descriptors, which wait for those jobs only. */
static void age_locked(file_t *f, int d, closing_t *c) {
    uint32_t gen = atomic_load(&f->copy_gen[d]);
    int fd = atomic_load(&f->fd[d]);
    if (fd >= 0 && f->jobs[d] > 0)
        retire_locked(f, d, fd); /* a job may still read it */
    else if (fd >= 0)
        closing_add(c, fd, f->fd_drive[d]);
    for (int i = 0; i < f->nretired; i++)
        if (f->retired_on[i] == d && f->retired_gen[i] == gen)
            f->retired_readers[i] = f->jobs[d];
    f->jobs[d] = 0;
    /* Also over an open under way (FD_OPENING): its opener finds the generation moved, closes
     * what it opened and stores nothing (opened), and the new copy's jobs never wait for it. */
    atomic_store(&f->fd[d], FD_CLOSED);
}

int file_set_copy(file_t *f, int d, const ident_t *ident) {
    closing_t c = {.n = 0};
    pthread_mutex_lock(&f->lock);
    int fd = atomic_load(&f->fd[d]);
    if (fd >= 0 && f->jobs[d] > 0 && f->nretired == RETIRED_SLOTS) {
        pthread_mutex_unlock(&f->lock);
        return EBUSY;
    }
    age_locked(f, d, &c);
    set_verdict_locked(f, d, ident);
    take_retired_locked(f, &c, d);
    pthread_cond_broadcast(&f->opened); /* jobs of the old copy waiting for its open: stale now */
    pthread_mutex_unlock(&f->lock);
    close_taken(&c);
    return 0;
}

/* The mirror copy's descriptor, opened (and checked unchanged) on first use, and again once its
 * mirror came back up. The open runs without the file's lock: on a hung mirror it may never
 * return, and opens and releases of the file must not wait for it. Other jobs of the same copy
 * wait for it (their requests have their own timeouts); jobs of a newer copy never do (a reload,
 * a mirror removed or put in its place: file_set_copy). The job's reference on the file keeps it
 * from being released while the job opens a descriptor or reads one. */
static int mirror_fd(engine_t *e, job_t *j) {
    file_t *f = j->f;
    int d = j->drive;
    uint32_t epoch = atomic_load(&e->epoch[d]);
    uint32_t opened_at = atomic_load(&f->fd_epoch[d]); /* before fd: a renewal stores fd first */
    int fd = atomic_load(&f->fd[d]);
    /* copy_gen after fd: unmoved since the hand-out, so fd is of the job's copy, not a newer one's
     * (whose retirement waits for its own jobs only) */
    if ((fd >= 0 || fd == FD_FAILED || fd == FD_CHANGED) && opened_at == epoch &&
        atomic_load(&f->copy_gen[d]) == j->gen)
        return fd;
    pthread_mutex_lock(&f->lock);
    while ((fd = atomic_load(&f->fd[d])) == FD_OPENING && atomic_load(&f->copy_gen[d]) == j->gen)
        pthread_cond_wait(&f->opened, &f->lock);
    if (atomic_load(&f->copy_gen[d]) != j->gen) { /* a reload changed the copy since the hand-out: */
        pthread_mutex_unlock(&f->lock);          /* opening it now would keep a descriptor nobody */
        j->changed = 1;                           /* closes (a dropped copy's); judged stale */
        return FD_CLOSED;
    }
    fd = renew_locked(e, f, d, fd);
    if (fd != FD_CLOSED) { /* opened (or failed) by another job meanwhile */
        pthread_mutex_unlock(&f->lock);
        return fd;
    }
    atomic_store(&f->fd[d], FD_OPENING);
    epoch = atomic_load(&e->epoch[d]); /* what this open is from (the lock orders it after renew) */
    ident_t want = f->ident[d];
    uint32_t gen = atomic_load(&f->copy_gen[d]);
    pthread_mutex_unlock(&f->lock);

    int direct;
    call_begin(j->dg);
    fd = open_backing(e, d, j->dg->root, f->relpath, &direct);
    if (fd < 0) {
        j->no_fds = errno == EMFILE || errno == ENFILE;
        snprintf(j->what, sizeof j->what, "cannot open %s (%s)", f->relpath, strerror(errno));
        j->opened_failed = 1;
    } else if (!same_identity(fd, &want, j->what, sizeof j->what)) {
        close(fd);
        j->changed = 1;
        fd = -1;
    }
    call_end(j->dg);
    return opened(j, fd, direct, epoch, gen);
}

uint64_t mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* A read starts or ends on drive generation g (NULL: the primary): the time with at least one read
 * running is the drive's busy time, what its measured rate (bytes per busy second, colifs.balance)
 * divides by. Added up at every start and end, so a drive that is never idle still shows its busy
 * time as it goes. A generation's reads count for its slot only while it is in force: a read stuck
 * in a removed drive does not make the mirror in its place look busy. */
static void drive_active(engine_t *e, drive_t *g, int delta) {
    activity_t *a = g ? &g->act : &e->primary_act;
    pthread_mutex_lock(&a->m);
    uint64_t now = mono_ns();
    if (a->running > 0 && !(g && atomic_load(&g->retired)))
        atomic_fetch_add(&e->ctr.drive_busy_ns[g ? g->slot : 0], now - a->since);
    a->since = now;
    a->running += delta;
    pthread_mutex_unlock(&a->m);
}

/* Pieces a waiting reader needs from drive d: +n handed out, -1 each read (or given up). While
 * exactly one drive has some, the others sit idle while a reader waits on it: that time is the
 * drive's time alone, what colifs.balance moves share away from. Unlike busy time it is not
 * flattered by a drive that reads in bursts when lightly used (a throttle, an SLC cache). */
static void waiting_change(engine_t *e, const int *delta) {
    pthread_mutex_lock(&e->waiting.m);
    uint64_t now = mono_ns();
    int only = -1, with = 0;
    for (int x = 0; x < MAX_REPLICAS; x++) {
        if (e->waiting.pending[x] > 0) {
            only = x;
            with++;
        }
    }
    if (with == 1) /* added up at changes only: a window sees a long wait once it ends */
        atomic_fetch_add(&e->ctr.drive_alone_ns[only], now - e->waiting.since);
    e->waiting.since = now;
    for (int x = 0; x < MAX_REPLICAS; x++)
        e->waiting.pending[x] += delta[x];
    pthread_mutex_unlock(&e->waiting.m);
}

static void waiting_on(engine_t *e, int d, int delta) {
    int v[MAX_REPLICAS] = {0};
    v[d] = delta;
    waiting_change(e, v);
}

static void run_job(engine_t *e, job_t *j) {
    if (!j->usable) {
        j->changed = 1; /* judged stale */
        j->got = -1;
        return;
    }
    int fd = mirror_fd(e, j);
    if (fd == FD_CHANGED && !j->changed) {
        j->changed = 1; /* another job found the copy changed: so is this one's, for the same reason
                           (whichever job's report comes first is the one the file's note shows) */
        pthread_mutex_lock(&j->f->lock);
        const char *why = j->f->changed_why[j->drive];
        snprintf(j->what, sizeof j->what, "%s", why ? why : "changed (found when opened)");
        pthread_mutex_unlock(&j->f->lock);
    }
    if (fd < 0) {
        j->got = -1;
        j->err = EIO;
        if (!j->opened_failed && !j->changed) {
            snprintf(j->what, sizeof j->what, "cannot open %s (failed before)", j->f->relpath);
            j->opened_failed = 1;
        }
        return;
    }
    drive_active(e, j->dg, 1);
    call_begin(j->dg);
    j->got = pread_as(fd, j->dst, j->len, j->off, j->f->direct[j->drive], j->via_cache);
    int err = errno;
    drive_active(e, j->dg, -1);
    if (j->got < 0) {
        call_end(j->dg);
        j->err = err;
        snprintf(j->what, sizeof j->what, "read error at %llu: %s", (unsigned long long)j->off,
                 strerror(j->err));
        return;
    }
    if (!same_identity(fd, &j->want, j->what, sizeof j->what))
        j->changed = 1;
    call_end(j->dg);
}

static void pending_unref_locked(pending_t *p, int *last) { *last = --p->refs == 0; }

static void pending_free(pending_t *p) {
    if (p->abandoned && p->release)
        p->release(p->arg);
    pthread_mutex_destroy(&p->m);
    pthread_cond_destroy(&p->c);
    free(p);
}

static void finish_job(engine_t *e, job_t *j) {
    pending_t *p = j->p;
    int last;
    pthread_mutex_lock(&p->m);
    j->done = 1;
    if (j->waited) /* else the reading stopped waiting for it (collect: timed out) */
        waiting_on(e, j->drive, -1);
    p->left--;
    pending_unref_locked(p, &last);
    pthread_cond_signal(&p->c);
    pthread_mutex_unlock(&p->m);
    if (last)
        pending_free(p);
}

/* The reading gave up on this job (timed out) before it started: nobody wants its bytes, and on a
 * slow or hung mirror stale jobs would queue in front of new ones. */
static int given_up(job_t *j) {
    pthread_mutex_lock(&j->p->m);
    int gone = j->p->abandoned;
    pthread_mutex_unlock(&j->p->m);
    return gone;
}

/* A job's bytes and itself leave the slot's backlog and in-flight gauge; unless its generation was
 * retired meanwhile, which took its share out of them already (gen_retire). */
static void settle(engine_t *e, drive_t *g, const job_t *j) {
    pthread_mutex_lock(&g->m);
    g->queued -= j->len;
    g->busy--;
    if (!atomic_load(&g->retired)) {
        atomic_fetch_sub(&e->ctr.drive_busy[g->slot], 1);
        atomic_fetch_sub(&e->queued[g->slot], j->len);
    }
    pthread_mutex_unlock(&g->m);
}

/* A job over (read, skipped or stale): its reading hears of it, then its hold on the file ends. */
static void job_over(engine_t *e, job_t *j) {
    file_t *f = j->f;
    int d = j->drive;
    uint32_t gen = j->gen;
    finish_job(e, j); /* j may be freed from here */
    job_done(e, f, d, gen);
}

static void *drive_main(void *arg) {
    drive_t *g = arg;
    for (;;) {
        pthread_mutex_lock(&g->m);
        while (!g->head && !g->stop)
            pthread_cond_wait(&g->c, &g->m);
        job_t *j = g->head;
        if (!j) {
            pthread_mutex_unlock(&g->m);
            return NULL;
        }
        g->head = j->next;
        if (!g->head)
            g->tail = NULL;
        pthread_mutex_unlock(&g->m);
        if (given_up(j)) {
            j->got = -1;
            j->err = ECANCELED;
            atomic_fetch_add(&g->e->ctr.fallbacks[1], 1);
        } else {
            run_job(g->e, j);
        }
        settle(g->e, g, j);
        job_over(g->e, j);
    }
}

/* A job of a retired generation, not read: its copy was taken out before the generation retired,
 * so it is judged stale and its piece read from the primary. */
static void end_stale(engine_t *e, job_t *j) {
    j->usable = 0;
    j->changed = 1;
    j->got = -1;
    job_over(e, j);
}

/* A job into the queue of the generation it was handed out in. If that one was retired since, the
 * job is not read: its copy was taken out before (a removal takes every copy out, then retires), so
 * it is judged stale and its piece read from the primary. */
static void submit(engine_t *e, job_t *j) {
    drive_t *g = j->dg;
    j->next = NULL;
    pthread_mutex_lock(&g->m);
    if (g->stop) {
        pthread_mutex_unlock(&g->m);
        end_stale(e, j);
        return;
    }
    g->queued += j->len;
    g->busy++;
    atomic_fetch_add(&e->ctr.drive_busy[g->slot], 1);
    atomic_fetch_add(&e->queued[g->slot], j->len);
    if (g->tail)
        g->tail->next = j;
    else
        g->head = j;
    g->tail = j;
    pthread_cond_signal(&g->c);
    pthread_mutex_unlock(&g->m);
}

/* -- a mirror slot's generations ---------------------------------------------------------------- */

static void gen_stop(drive_t *g) {
    pthread_mutex_lock(&g->m);
    g->stop = 1;
    pthread_cond_broadcast(&g->c);
    pthread_mutex_unlock(&g->m);
}

static void gen_free(drive_t *g) {
    free(g->threads);
    pthread_mutex_destroy(&g->m);
    pthread_cond_destroy(&g->c);
    pthread_mutex_destroy(&g->act.m);
    free(g);
}

/* A generation of slot d reading `root`, its threads started; NULL and an errno if they could not
 * all start (those that did are stopped and joined: nothing was queued to them). */
static drive_t *gen_start(engine_t *e, int d, const char *root, uint32_t number, int *err) {
    drive_t *g = calloc(1, sizeof *g);
    pthread_t *threads = calloc((size_t)e->drive_threads, sizeof(pthread_t));
    *err = ENOMEM;
    if (!g || !threads) {
        free(g);
        free(threads);
        return NULL;
    }
    *g = (drive_t){.e = e, .slot = d, .number = number, .root = root, .threads = threads};
    pthread_mutex_init(&g->m, NULL);
    pthread_cond_init(&g->c, NULL);
    pthread_mutex_init(&g->act.m, NULL);
    *err = 0;
    for (int t = 0; t < e->drive_threads && !*err; t++) {
        *err = pthread_create(&g->threads[t], NULL, drive_main, g);
        g->nthreads += !*err;
    }
    if (!*err)
        return g;
    gen_stop(g);
    for (int t = 0; t < g->nthreads; t++)
        pthread_join(g->threads[t], NULL);
    gen_free(g);
    return NULL;
}

int drive_start(engine_t *e, int d) {
    int err;
    drive_t *g = gen_start(e, d, e->roots[d], 1, &err);
    if (g)
        atomic_store(&e->drives[d], g);
    return err;
}

int drives_start(engine_t *e) {
    for (int d = 1; d < e->nrep; d++) {
        int err = drive_start(e, d);
        if (err)
            return err;
    }
    return 0;
}

/* No newer job comes to g: its threads end once they have run what it holds, and its share of the
 * slot's backlog, in-flight gauge and busy time is the slot's no longer. */
static void gen_retire(engine_t *e, drive_t *g) {
    pthread_mutex_lock(&g->m);
    g->stop = 1;
    atomic_fetch_sub(&e->queued[g->slot], g->queued);
    atomic_fetch_sub(&e->ctr.drive_busy[g->slot], (uint64_t)g->busy);
    atomic_store(&g->retired, 1);
    pthread_cond_broadcast(&g->c);
    pthread_mutex_unlock(&g->m);
}

/* The threads of retired generations that have ended are joined (a stuck one is left). */
static void gen_reap(drive_t *g) {
    for (; g; g = g->older) {
        while (g->joined < g->nthreads && pthread_tryjoin_np(g->threads[g->joined], NULL) == 0)
            g->joined++;
    }
}

/* The jobs a retired generation still queues (its threads may all be stuck in a hung drive) end
 * stale at once: their copies were taken out before, and their readings read the primary instead
 * of waiting out the mirror timeout (for ever without one). */
static void gen_drain(engine_t *e, drive_t *g) {
    pthread_mutex_lock(&g->m);
    job_t *j = g->head;
    g->head = g->tail = NULL;
    pthread_mutex_unlock(&g->m);
    while (j) {
        job_t *next = j->next;
        settle(e, g, j);
        end_stale(e, j);
        j = next;
    }
}

static void *drain_main(void *arg) {
    drive_t *g = arg;
    gen_drain(g->e, g);
    return NULL;
}

/* gen_drain on a thread of its own, one of the generation's (joined or detached with them): ending
 * a job may close a descriptor on the hung drive, or wait for a file's lock that a slow primary
 * open holds, and the caller is the daemon's loop. On the caller's thread if none can start. */
static void gen_drain_aside(drive_t *g) {
    pthread_t *grown = realloc(g->threads, (size_t)(g->nthreads + 1) * sizeof *grown);
    if (grown) {
        g->threads = grown;
        if (pthread_create(&g->threads[g->nthreads], NULL, drain_main, g) == 0) {
            g->nthreads++;
            return;
        }
    }
    gen_drain(g->e, g);
}

int drive_renew(engine_t *e, int d, const char *root, uint32_t *retired) {
    drive_t *old = atomic_load(&e->drives[d]);
    int err;
    drive_t *g = gen_start(e, d, root ? root : old->root, old->number + 1, &err);
    if (!g)
        return err;
    g->older = old;
    atomic_store(&e->drives[d], g); /* jobs handed out from now on are the new generation's */
    gen_retire(e, old);
    gen_drain_aside(old);
    gen_reap(old);
    *retired = old->number;
    return 0;
}

int drive_calls(engine_t *e, int d, uint32_t number) {
    for (drive_t *g = atomic_load(&e->drives[d]); g; g = g->older)
        if (g->number == number)
            return atomic_load(&g->in_calls);
    return 0;
}

/* Stop every generation's threads once their queues are empty. A thread stuck in a read on a hung
 * drive is detached instead of waited for: it must not hang the unmount (what it reads into stays
 * allocated: a request buffer or a fill's memory, and so does the engine). */
void drives_stop(engine_t *e) {
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    for (int d = 1; d < MAX_REPLICAS; d++)
        for (drive_t *g = atomic_load(&e->drives[d]); g; g = g->older)
            gen_stop(g);
    for (int d = 1; d < MAX_REPLICAS; d++) {
        for (drive_t *g = atomic_load(&e->drives[d]); g; g = g->older) {
            for (; g->joined < g->nthreads; g->joined++) {
                if (pthread_timedjoin_np(g->threads[g->joined], NULL, &deadline) != 0) {
                    pthread_detach(g->threads[g->joined]);
                    e->threads_left = 1;
                }
            }
        }
    }
}

void drives_free(engine_t *e) {
    for (int d = 1; d < MAX_REPLICAS; d++) {
        drive_t *g = atomic_exchange(&e->drives[d], NULL);
        while (g) {
            drive_t *older = g->older;
            gen_free(g);
            g = older;
        }
    }
}

/* -- planning: [start, end) -> runs of one drive each, as colifs.readplan.plan() cuts them --------- */

static uint32_t usable(engine_t *e, file_t *f) {
    uint32_t m = atomic_load(&f->mask) & atomic_load(&e->up) & ~atomic_load(&f->dropped);
    for (int d = 1; d < e->nrep; d++) {
        int fd = atomic_load(&f->fd[d]);
        if ((m & (1u << d)) && (fd == FD_FAILED || fd == FD_CHANGED) &&
            atomic_load(&f->fd_epoch[d]) == atomic_load(&e->epoch[d]))
            m &= ~(1u << d); /* failed to open (or changed) since the mirror was last up */
    }
    return m | 1u;
}

uint32_t segment_at(const file_t *f, uint64_t off) {
    uint32_t lo = 0, hi = f->nseg; /* last segment starting at or before off */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (f->seg_start[mid] <= off)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

typedef struct {
    piece_t *runs;
    size_t n;
    int started;
    uint64_t bound;
    int drive;
} snapper_t;

static void snap_emit(snapper_t *s, uint64_t a, uint64_t b, int d) {
    if (a >= b)
        return;
    if (s->n && s->runs[s->n - 1].drive == d) {
        s->runs[s->n - 1].end = b;
        return;
    }
    s->runs[s->n++] = (piece_t){.start = a, .end = b, .drive = d};
}

/* A run of drive d starts at s: run boundaries move to the nearest BLOCK multiple (every copy holds
 * the same bytes), so each run is read with O_DIRECT straight into its place in one buffer. */
static void snap_feed(snapper_t *s, uint64_t at, int d) {
    if (!s->started) {
        s->started = 1;
        s->bound = at;
        s->drive = d;
        return;
    }
    uint64_t b = (at + BLOCK / 2) & ~(uint64_t)(BLOCK - 1);
    snap_emit(s, s->bound, b, s->drive);
    s->bound = b;
    s->drive = d;
}

/* A copy of one column's routes, taken once per request (see route_t). */
typedef struct {
    uint64_t bound[MAX_REPLICAS];
    uint8_t seq[STRIPE_SLOTS];
    uint32_t allowed; /* the column's drives (bit d) */
    int nrep;         /* the replicas its bounds cover */
} routes_now_t;

static void routes_now(engine_t *e, uint32_t col, routes_now_t *r) {
    const route_t *rt = &e->routes[col];
    uint64_t before, after;
    do {
        before = atomic_load_explicit(&e->routes_gen, memory_order_acquire);
        r->nrep = atomic_load_explicit(&e->nrep, memory_order_relaxed);
        for (int d = 0; d < r->nrep; d++)
            r->bound[d] = atomic_load_explicit(&rt->bound[d], memory_order_relaxed);
        for (int k = 0; k < STRIPE_SLOTS; k++)
            r->seq[k] = atomic_load_explicit(&rt->seq[k], memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        after = atomic_load_explicit(&e->routes_gen, memory_order_relaxed);
    } while ((before & 1) || before != after);
    r->allowed = (col << 1) | 1u;
}

/* The drive of the byte at `at` of segment i, and where that drive's piece ends (a stripe chunk's
 * end, or the segment's), as colifs.readplan.table_drive gives it. */
static int segment_drive(const file_t *f, const routes_now_t *r, uint32_t i, uint64_t at,
                         uint64_t seg_end, uint64_t *piece_end) {
    *piece_end = seg_end;
    if (f->seg_key[i] < 0)
        return 0;
    if (f->seg_rot[i] != NOT_STRIPED) {
        uint64_t chunk = at / CHUNK;
        if ((chunk + 1) * CHUNK < seg_end)
            *piece_end = (chunk + 1) * CHUNK;
        int d = r->seq[(chunk + (uint64_t)f->seg_rot[i]) % STRIPE_SLOTS];
        return (r->allowed >> d) & 1 ? d : 0;
    }
    for (int d = 0; d < r->nrep; d++)
        if (f->seg_pos[i] < r->bound[d])
            return (r->allowed >> d) & 1 ? d : 0; /* the check set_routes made: never outside */
    return 0;
}

/* --routing queue: the routes' drive d for a piece of `len` bytes, unless d has a backlog (at least
 * SPILL_MIN bytes queued) and another drive would have read the piece SPILL_RATIO times sooner:
 * the fewest bytes queued per byte per second the drive delivered lately (its measured speed,
 * colifs.balance), or, until every drive the column allows was measured, per unit of the column's
 * weight. Below that the routes decide: a page-cache reader's one or two requests in flight
 * (readahead hides a slow drive's latency there) get both drives in the weights' ratio, as
 * without this; a backlog (a drive slower than its weight, many readers, or one reader's many
 * requests when the weights are wrong) spills to the drive that has room. `extra`: the request's
 * own pieces planned so far (not queued yet). Approximate by design: requests planned at the same
 * moment see the same queues, and a lightly used drive's measured speed runs high (which only
 * makes it take a backlog sooner). */
#define SPILL_MIN (2u << 20)
#define SPILL_RATIO 2.0

/* Per drive, what a queued byte is divided by to compare drives: their speeds once every drive the
 * column gives a share was measured, else their shares; 0 for a drive the column gives nothing. */
static void pace(engine_t *e, const routes_now_t *r, uint64_t *per) {
    uint64_t share[MAX_REPLICAS] = {0}, prev = 0;
    int measured = 1;
    for (int x = 0; x < r->nrep; x++) {
        share[x] = (r->allowed >> x) & 1 ? r->bound[x] - prev : 0;
        prev = r->bound[x];
        per[x] = atomic_load_explicit(&e->speed[x], memory_order_relaxed);
        measured &= per[x] > 0 || !share[x];
    }
    for (int x = 0; x < r->nrep; x++)
        if (!measured || !share[x])
            per[x] = share[x];
}

static int quickest(engine_t *e, const routes_now_t *r, const uint64_t *extra, uint64_t len, int d) {
    uint64_t queued[MAX_REPLICAS] = {0}, per[MAX_REPLICAS] = {0};
    for (int x = 0; x < r->nrep; x++)
        queued[x] = atomic_load_explicit(&e->queued[x], memory_order_relaxed) + extra[x];
    if (queued[d] < SPILL_MIN)
        return d;
    pace(e, r, per);
    if (!per[d])
        return d;
    int best = d;
    double own = (double)(queued[d] + len) / (double)per[d], best_cost = own;
    for (int x = 0; x < r->nrep; x++) {
        if (x == d || !((r->allowed >> x) & 1) || !per[x])
            continue;
        double cost = (double)(queued[x] + len) / (double)per[x];
        if (cost < best_cost)
            best = x, best_cost = cost;
    }
    /* Only a clear backlog spills: at parity a piece moved to a slower drive ends last (one reader
     * of a whole expert waits for its slowest piece). */
    return best_cost * SPILL_RATIO < own ? best : d;
}

/* --routing queue: the drive that reads the piece first, counting what this request already gave
 * each drive (extra); the bytes of [from, end) moved off their routed drive are counted. */
static int requeued(engine_t *e, const routes_now_t *r, uint64_t *extra, int routed, uint64_t pos, uint64_t from,
                    uint64_t end) {
    int d = quickest(e, r, extra, end - pos, routed);
    extra[d] += end - pos;
    if (d != routed && end > from)
        atomic_fetch_add(&e->ctr.drive_spilled[routed], end - from);
    return d;
}

/* What [from, end) of key k asked of drive d: its bytes, and one read per key a request touches. */
static void count_key(engine_t *e, int32_t k, int d, uint64_t from, uint64_t end, int32_t *last_key) {
    if (k < 0 || end <= from)
        return;
    atomic_fetch_add(&e->ctr.key_bytes[(size_t)k * MAX_REPLICAS + (size_t)d], end - from);
    if (k != *last_key)
        atomic_fetch_add(&e->ctr.key_reads[k], 1);
    *last_key = k;
}

/* What [start, end) of f asked of drive d, key by key (count_key): a fill counts its pieces on
 * the drives that read them, known only once they are queued. */
void count_span(engine_t *e, const file_t *f, uint64_t start, uint64_t end, int d, int32_t *last_key) {
    for (uint32_t i = segment_at(f, start); start < end && i < f->nseg; i++) {
        uint64_t b = min_u64(end, i + 1 < f->nseg ? f->seg_start[i + 1] : f->size);
        count_key(e, f->seg_key[i], d, start, b, last_key);
        start = max_u64(start, b);
    }
}

#define QUICK_RATIO 2.0 /* how much quicker than every other drive the quickest must be */

/* The quickest of f's usable drives (measured speed, else weight), if it is clearly quicker than
 * every other (QUICK_RATIO), or the only one: where a piece a request waits for is read soonest (it
 * goes to the head of that drive's queue). -1 when drives are about as quick: then the routes split
 * the request, and its pieces are read on every drive at once, sooner than on one. */
int quickest_drive(engine_t *e, file_t *f) {
    routes_now_t r;
    uint64_t per[MAX_REPLICAS] = {0};
    routes_now(e, (usable(e, f) >> 1) & (uint32_t)(e->ncols - 1), &r);
    pace(e, &r, per);
    int best = 0;
    uint64_t next = 0;
    for (int x = 1; x < r.nrep; x++)
        if ((r.allowed >> x) & 1 && per[x] > per[best])
            best = x;
    for (int x = 0; x < r.nrep; x++)
        if (x != best && (r.allowed >> x) & 1)
            next = max_u64(next, per[x]);
    return (double)per[best] >= QUICK_RATIO * (double)next ? best : -1;
}

/* Cut [start, end) into runs of one drive each, by the routes in force for the file's usable
 * drives (or, PLAN_PRIMARY, all on the primary), their last run ending at stop, and count what
 * [off, end) asked of each key (not with PLAN_KEYS_LATER). Returns the number of runs: at most
 * runs_bound(). */
size_t plan_runs(engine_t *e, file_t *f, uint64_t start, uint64_t end, uint64_t stop, uint64_t off,
                 int how, piece_t *runs) {
    snapper_t s = {runs, 0, 0, 0, 0};
    routes_now_t r;
    int primary_only = how & PLAN_PRIMARY;
    routes_now(e, primary_only ? 0 : (usable(e, f) >> 1) & (uint32_t)(e->ncols - 1), &r);
    uint32_t i = segment_at(f, start);
    uint64_t pos = start;
    int have = 0, drive = 0;
    int32_t last_key = -1;
    uint64_t extra[MAX_REPLICAS] = {0};
    int requeue = e->queue_routing && !primary_only;
    while (pos < end && i < f->nseg) {
        uint64_t seg_end = i + 1 < f->nseg ? f->seg_start[i + 1] : f->size, piece_end;
        int d = segment_drive(f, &r, i, pos, seg_end, &piece_end);
        piece_end = min_u64(piece_end, end);
        int32_t k = f->seg_key[i];
        uint64_t from = max_u64(pos, off);
        if (requeue && k >= 0)
            d = requeued(e, &r, extra, d, pos, from, piece_end);
        if (!(how & PLAN_KEYS_LATER))
            count_key(e, k, d, from, piece_end, &last_key);
        if (!have || d != drive) {
            snap_feed(&s, pos, d);
            have = 1;
            drive = d;
        }
        pos = piece_end;
        i += pos >= seg_end;
    }
    if (!have)
        snap_feed(&s, start, 0);
    snap_emit(&s, s.bound, stop, s.drive);
    return s.n;
}

/* Column c's bounds rise to the whole range and give positions, and its stripe sequence chunks,
 * only to the drives the column allows (the primary, and the mirrors of its set). */
static int column_ok(int nrep, const uint8_t *row, int c) {
    uint32_t allowed = ((uint32_t)c << 1) | 1u;
    uint64_t prev = 0, b = 0;
    for (int d = 0; d < nrep; d++, prev = b) {
        memcpy(&b, row + 8 * d, 8);
        if (b < prev || b > (1ull << 32) || (b > prev && !(allowed & (1u << d))))
            return 0;
    }
    for (int k = 0; k < STRIPE_SLOTS; k++) {
        uint8_t d = row[8 * nrep + k];
        if (d >= nrep || !(allowed & (1u << d)))
            return 0;
    }
    return b == 1ull << 32;
}

/* Routes for nrep replicas: one column per set of mirrors, each valid (column_ok). */
static int routes_ok(const uint8_t *data, size_t len, int nrep) {
    int ncols = 1 << (nrep - 1);
    size_t width = 8 * (size_t)nrep + STRIPE_SLOTS;
    if (nrep > MAX_REPLICAS || len != width * (size_t)ncols)
        return 0;
    for (int c = 0; c < ncols; c++)
        if (!column_ok(nrep, data + (size_t)c * width, c))
            return 0;
    return 1;
}

/* Routes checked by routes_ok, for nrep replicas (one writer at a time: the GIL); the counts
 * change inside the sequence lock's window, so a request copies routes and count of one
 * generation. */
static void write_routes(engine_t *e, const uint8_t *data, int nrep) {
    int ncols = 1 << (nrep - 1);
    size_t width = 8 * (size_t)nrep + STRIPE_SLOTS;
    uint64_t gen = atomic_load_explicit(&e->routes_gen, memory_order_relaxed);
    atomic_store_explicit(&e->routes_gen, gen + 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    for (int c = 0; c < ncols; c++) {
        const uint8_t *row = data + (size_t)c * width;
        route_t *rt = &e->routes[c];
        for (int d = 0; d < nrep; d++) {
            uint64_t b;
            memcpy(&b, row + 8 * d, 8);
            atomic_store_explicit(&rt->bound[d], b, memory_order_relaxed);
        }
        for (int k = 0; k < STRIPE_SLOTS; k++)
            atomic_store_explicit(&rt->seq[k], row[8 * nrep + k], memory_order_relaxed);
    }
    atomic_store_explicit(&e->ncols, ncols, memory_order_relaxed);
    atomic_store_explicit(&e->nrep, nrep, memory_order_relaxed);
    atomic_store_explicit(&e->routes_gen, gen + 2, memory_order_release);
}

int set_routes(engine_t *e, const uint8_t *data, size_t len) {
    int nrep = atomic_load(&e->nrep);
    if (!routes_ok(data, len, nrep)) /* every column checked before any is changed */
        return -1;
    write_routes(e, data, nrep);
    return 0;
}

int add_drive(engine_t *e, const uint8_t *routes, size_t len) {
    int d = atomic_load(&e->nrep);
    if (!routes_ok(routes, len, d + 1)) /* before a thread starts */
        return -1;
    int err = drive_start(e, d); /* nothing started if it fails */
    if (err)
        return err;
    atomic_fetch_or(&e->up, 1u << d);
    write_routes(e, routes, d + 1);
    return 0;
}


size_t runs_bound(const file_t *f, uint64_t start, uint64_t end) {
    uint64_t blocks = (end - start) / BLOCK + 2;
    uint64_t changes = (uint64_t)(segment_at(f, end - 1) - segment_at(f, start)) + (end - start) / CHUNK + 3;
    return (size_t)(changes < blocks ? changes : blocks);
}

/* -- reading ---------------------------------------------------------------------------------- */

static uint64_t overlap(uint64_t s, uint64_t e, uint64_t off, uint64_t end) {
    uint64_t a = s > off ? s : off, b = e < end ? e : end;
    return b > a ? b - a : 0;
}

static int wait_jobs(engine_t *e, pending_t *p) {
    int timed_out = 0;
    struct timespec deadline;
    if (e->mirror_timeout > 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        double t = e->mirror_timeout;
        deadline.tv_sec += (time_t)t;
        deadline.tv_nsec += (long)((t - (double)(time_t)t) * 1e9);
        if (deadline.tv_nsec >= 1000000000) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000;
        }
    }
    pthread_mutex_lock(&p->m);
    while (p->left > 0 && !timed_out) {
        if (e->mirror_timeout > 0)
            timed_out = pthread_cond_timedwait(&p->c, &p->m, &deadline) == ETIMEDOUT && p->left > 0;
        else
            pthread_cond_wait(&p->c, &p->m);
    }
    return timed_out; /* p->m stays locked: the caller collects the results */
}

static pthread_condattr_t mono_attr;
static pthread_once_t mono_once = PTHREAD_ONCE_INIT;

static void mono_init(void) {
    pthread_condattr_init(&mono_attr);
    pthread_condattr_setclock(&mono_attr, CLOCK_MONOTONIC);
}

static pending_t *pending_new(size_t njobs) {
    pending_t *p = calloc(1, sizeof(pending_t) + njobs * sizeof(job_t));
    if (!p)
        return NULL;
    pthread_once(&mono_once, mono_init);
    pthread_mutex_init(&p->m, NULL);
    pthread_cond_init(&p->c, &mono_attr);
    p->left = (int)njobs;
    p->refs = (int)njobs + 1;
    return p;
}

/* One note per kind and drive: a reading counts once against a drive's health however many of its
 * pieces failed there (a fill has dozens on one drive). */
static void note(notes_t *nt, int kind, int drive, int timed_out, uint32_t gen, const char *what) {
    for (size_t i = 0; i < nt->n; i++) {
        if (nt->v[i].kind == kind && nt->v[i].drive == drive) {
            nt->v[i].timed_out |= timed_out; /* health counts a timeout apart from an error */
            return;
        }
    }
    if (nt->n == MAX_NOTES)
        return;
    nt->v[nt->n].kind = kind;
    nt->v[nt->n].drive = drive;
    nt->v[nt->n].timed_out = timed_out;
    nt->v[nt->n].gen = gen;
    snprintf(nt->v[nt->n].what, sizeof nt->v[nt->n].what, "%s", what);
    nt->n++;
}

/* A piece that holds its bytes: counted as served by its drive (within the counted range). */
static void landed(engine_t *e, const reading_t *how, piece_t *pc, size_t i) {
    uint64_t upto = pc[i].start + (uint64_t)pc[i].got;
    atomic_fetch_add(&e->ctr.drive_bytes[pc[i].drive], overlap(pc[i].start, upto, how->count_from, how->count_to));
    atomic_fetch_add(&e->ctr.drive_reads[pc[i].drive], 1);
    if (pc[i].drive)
        atomic_fetch_add(&e->ctr.drive_ok[pc[i].drive], 1);
    if (how->ready)
        how->ready(how->arg, i);
}

/* A piece read from the primary, inline on the caller's thread (drive 0 from now on). `queued`:
 * its bytes are in the primary's backlog already (read_mirrors adds a reading's primary pieces at
 * once, as the drive threads' queues hold the mirrors'); it leaves it once read. */
static void read_primary(engine_t *e, file_t *f, piece_t *pc, const reading_t *how, size_t i, int queued) {
    pc[i].drive = 0;
    uint64_t len = pc[i].end - pc[i].start;
    atomic_fetch_add(&e->ctr.drive_busy[0], 1);
    if (!queued)
        atomic_fetch_add(&e->queued[0], len);
    drive_active(e, NULL, 1);
    pc[i].got = pread_as(atomic_load(&f->fd[0]), pc[i].dst, len, pc[i].start, f->direct[0], how->via_cache);
    pc[i].err = pc[i].got < 0 ? errno : 0;
    drive_active(e, NULL, -1);
    atomic_fetch_sub(&e->queued[0], len);
    atomic_fetch_sub(&e->ctr.drive_busy[0], 1);
    pc[i].status = pc[i].err ? RES_FAILED : RES_OK;
    if (!pc[i].err)
        landed(e, how, pc, i);
}

/* A job whose verdict is not the mirror's: late in a removed mirror's drive (its generation
 * retired: not held against what serves the slot now), not usable, or failed or changed while a
 * reload changed the copy. A job not done is read no further than its generation (it still runs). */
static int stale(const job_t *jb, uint64_t want) {
    if (!jb->done)
        return jb->dg && atomic_load(&jb->dg->retired);
    return !jb->usable || ((jb->changed || jb->got < 0 || (uint64_t)jb->got < want) &&
                           atomic_load(&jb->f->copy_gen[jb->drive]) != jb->gen);
}

/* A finished mirror job's verdict on its piece (called with the pending's lock held). */
static void judge(engine_t *e, job_t *jb, piece_t *pc, notes_t *nt) {
    const char *what = jb->what;
    char msg[200];
    uint64_t want = (pc->end < jb->f->size ? pc->end : jb->f->size) - pc->start;
    if (jb->done && jb->no_fds) {
        pc->status = RES_NO_FDS; /* read from the primary; nothing against the mirror's health */
        note(nt, EV_NO_FDS, jb->drive, 0, jb->gen, jb->what);
        return;
    }
    if (stale(jb, want)) {
        pc->status = RES_STALE; /* read from the primary; nothing against the mirror's health */
        return;
    }
    if (!jb->done) {
        pc->status = RES_TIMEOUT;
        snprintf(msg, sizeof msg, "timeout at %llu: no answer within %g s", (unsigned long long)jb->off,
                 e->mirror_timeout);
        what = msg;
    } else if (jb->changed) {
        pc->status = RES_CHANGED;
    } else if (jb->got < 0) {
        pc->status = RES_FAILED;
    } else if ((uint64_t)jb->got < want) {
        pc->status = RES_FAILED;
        snprintf(msg, sizeof msg, "short read at %llu: %lld of %llu bytes", (unsigned long long)jb->off,
                 (long long)jb->got, (unsigned long long)want);
        what = msg;
    } else {
        pc->status = RES_OK;
        pc->got = jb->got;
        return;
    }
    note(nt, pc->status == RES_CHANGED ? EV_MIRROR_CHANGED : EV_MIRROR_FAILED, jb->drive,
         pc->status == RES_TIMEOUT, jb->gen, what);
}

void note_timeout(engine_t *e, notes_t *nt, int drive, uint64_t off) {
    char msg[200];
    snprintf(msg, sizeof msg, "timeout at %llu: no answer within %g s", (unsigned long long)off, e->mirror_timeout);
    note(nt, EV_MIRROR_FAILED, drive, 1, 0, msg);
}

/* The mirror pieces' jobs, queued on their drives. Each job holds the file open until it is done:
 * a reading that gives up on a late job may release the file meanwhile, and a descriptor closed
 * under the job could be reused by any other open (a /dev/fuse clone, say) before its pread. */
static void hand_out(engine_t *e, file_t *f, piece_t *pc, size_t n, pending_t *p, size_t nm, const reading_t *how) {
    pthread_mutex_lock(&f->lock);
    f->refs += (int)nm;
    size_t j = 0;
    for (size_t i = 0; i < n; i++) {
        if (!pc[i].drive)
            continue;
        int d = pc[i].drive;
        f->jobs[d]++;
        uint32_t gen = atomic_load(&f->copy_gen[d]);
        pc[i].gen = gen;
        p->jobs[j++] = (job_t){.p = p, .f = f, .drive = d, .run = (int)i, .dst = pc[i].dst,
                               .off = pc[i].start, .len = pc[i].end - pc[i].start,
                               .want = f->ident[d], .gen = gen, .waited = how->waited, .via_cache = how->via_cache,
                               .usable = (atomic_load(&f->mask) >> d) & 1u,
                               .dg = atomic_load(&e->drives[d])};
    }
    pthread_mutex_unlock(&f->lock);
    for (size_t k = 0; k < nm; k++)
        submit(e, &p->jobs[k]);
}

/* Wait for the jobs (up to the mirror timeout) and judge each. When some time out, how->abandon
 * moves the pieces' bytes away from the memory the late jobs write into (before any of them can
 * finish) and names what how->release frees once they all have. 0, or abandon's ENOMEM. */
static int collect(engine_t *e, pending_t *p, size_t nm, piece_t *pc, size_t n, const reading_t *how,
                   notes_t *nt) {
    int err = 0;
    int timed_out = wait_jobs(e, p); /* returns with p->m held */
    for (size_t j = 0; j < nm; j++) {
        judge(e, &p->jobs[j], &pc[p->jobs[j].run], nt);
        if (!p->jobs[j].done && p->jobs[j].waited) { /* late: nobody waits for it from now on */
            p->jobs[j].waited = 0;
            waiting_on(e, p->jobs[j].drive, -1);
        }
    }
    if (timed_out) { /* still under p->m: no late job has finished since */
        p->abandoned = 1;
        p->release = how->release;
        err = how->abandon(how->arg, pc, n, &p->arg);
    }
    int last;
    pending_unref_locked(p, &last);
    pthread_mutex_unlock(&p->m);
    if (last)
        pending_free(p);
    return err;
}

/* A waiting reader's pieces, counted per drive (at once) before any is read. */
static void wait_for(engine_t *e, const piece_t *pc, size_t n) {
    int per[MAX_REPLICAS] = {0};
    for (size_t i = 0; i < n; i++)
        per[pc[i].drive]++;
    waiting_change(e, per);
}

/* The mirror pieces, on their drives' threads, while the caller reads the primary's. Returns 0,
 * or ENOMEM when the bytes could not be moved off late jobs' memory (then it is theirs). */
static int read_mirrors(engine_t *e, file_t *f, piece_t *pc, size_t n, const reading_t *how, notes_t *nt) {
    size_t nm = 0;
    for (size_t i = 0; i < n; i++)
        nm += pc[i].drive != 0;
    pending_t *p = nm ? pending_new(nm) : NULL;
    uint64_t inline_bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (!p) /* no mirror piece, or no memory for the jobs: the primary reads it all */
            pc[i].drive = 0;
        inline_bytes += pc[i].drive ? 0 : pc[i].end - pc[i].start;
    }
    atomic_fetch_add(&e->queued[0], inline_bytes);
    if (how->waited)
        wait_for(e, pc, n);
    if (p)
        hand_out(e, f, pc, n, p, nm, how);
    int inline_pieces = 0;
    for (size_t i = 0; i < n; i++) {
        if (!pc[i].drive) {
            read_primary(e, f, pc, how, i, 1);
            inline_pieces++;
        }
    }
    if (how->waited && inline_pieces) /* the primary's pending ends with its last piece */
        waiting_on(e, 0, -inline_pieces);
    return p ? collect(e, p, nm, pc, n, how, nt) : 0;
}

/* A copy found changed: not used again for the file, unless a reload validated it since (then its
 * generation moved: under the lock that file_set_copy changes both under). */
static void drop_copy(file_t *f, int d, uint32_t gen) {
    pthread_mutex_lock(&f->lock);
    if (atomic_load(&f->copy_gen[d]) == gen)
        atomic_fetch_or(&f->dropped, 1u << d);
    pthread_mutex_unlock(&f->lock);
}

/* Every mirror piece that failed (and, with how->reread_timeouts, every one that timed out) is
 * counted against its drive and re-read from the primary in place. 0, or the primary's errno. */
static int fall_back(engine_t *e, file_t *f, piece_t *pc, size_t n, const reading_t *how) {
    int err = 0;
    for (size_t i = 0; i < n; i++) {
        int d = pc[i].drive;
        if (!d || pc[i].status == RES_OK || (pc[i].status == RES_TIMEOUT && !how->reread_timeouts))
            continue;
        if (pc[i].status != RES_NO_FDS && pc[i].status != RES_STALE)
            atomic_fetch_add(&e->ctr.drive_errors[d], 1);
        atomic_fetch_add(e->ctr.fallbacks, 1);
        if (pc[i].status == RES_CHANGED)
            drop_copy(f, d, pc[i].gen);
        if (how->waited) /* the reader waits for the re-read too */
            waiting_on(e, 0, 1);
        read_primary(e, f, pc, how, i, 0);
        if (how->waited)
            waiting_on(e, 0, -1);
        if (pc[i].err)
            err = pc[i].err;
    }
    return err;
}

/* The primary failed a piece: noted once (its errno goes to the caller). */
static void note_primary(engine_t *e, piece_t *pc, size_t n, notes_t *nt) {
    for (size_t i = 0; i < n; i++) {
        if (pc[i].drive == 0 && pc[i].status == RES_FAILED) {
            char what[200];
            snprintf(what, sizeof what, "read error at %llu: %s", (unsigned long long)pc[i].start,
                     strerror(pc[i].err));
            note(nt, EV_PRIMARY_FAILED, 0, 0, 0, what);
            atomic_fetch_add(&e->ctr.drive_errors[0], 1);
            return;
        }
    }
}

void send_notes(engine_t *e, file_t *f, notes_t *nt) {
    int32_t fi = (int32_t)(f - e->files);
    for (size_t i = 0; i < nt->n; i++) {
        int d = nt->v[i].drive;
        if (nt->v[i].kind == EV_MIRROR_CHANGED && !(atomic_load(&f->dropped) & (1u << d)))
            continue; /* a reload validated the copy since: nothing to drop */
        e->event(e->py, nt->v[i].kind, d, fi, nt->v[i].what, nt->v[i].timed_out,
                 atomic_load(&e->ctr.drive_ok[d]), nt->v[i].gen);
    }
    nt->n = 0;
}

int read_pieces(engine_t *e, file_t *f, piece_t *pc, size_t n, const reading_t *how, notes_t *nt) {
    for (size_t i = 0; i < n; i++)
        pc[i].status = RES_FAILED; /* until read */
    int err = read_mirrors(e, f, pc, n, how, nt);
    if (err)
        return err;
    for (size_t i = 0; i < n; i++)
        if (pc[i].drive == 0 && pc[i].status == RES_FAILED)
            err = pc[i].err;
    for (size_t i = 0; i < n; i++)
        if (pc[i].drive && pc[i].status == RES_OK)
            landed(e, how, pc, i);
    if (!err)
        err = fall_back(e, f, pc, n, how);
    if (err)
        note_primary(e, pc, n, nt);
    return err;
}

int read_piece_here(engine_t *e, file_t *f, piece_t *pc, const reading_t *how, notes_t *nt) {
    pc->status = RES_FAILED;
    int d = pc->drive;
    if (!d) {
        read_primary(e, f, pc, how, 0, 1);
        if (pc->status == RES_FAILED)
            note_primary(e, pc, 1, nt);
        return pc->err;
    }
    pthread_mutex_lock(&f->lock); /* as hand_out: the job's hold on the file and its copy */
    f->refs++;
    f->jobs[d]++;
    job_t j = {.f = f, .drive = d, .dst = pc->dst, .off = pc->start, .len = pc->end - pc->start,
               .want = f->ident[d], .gen = atomic_load(&f->copy_gen[d]),
               .usable = (atomic_load(&f->mask) >> d) & 1u, .dg = atomic_load(&e->drives[d]),
               .via_cache = how->via_cache};
    pthread_mutex_unlock(&f->lock);
    pc->gen = j.gen;
    drive_t *g = j.dg; /* its share of the slot's gauges is its generation's, as submit keeps it */
    pthread_mutex_lock(&g->m);
    if (atomic_load(&g->retired)) /* retired before this piece was its: settle leaves the slot's */
        atomic_fetch_sub(&e->queued[d], j.len);
    else
        atomic_fetch_add(&e->ctr.drive_busy[d], 1);
    g->queued += j.len;
    g->busy++;
    pthread_mutex_unlock(&g->m);
    run_job(e, &j);
    settle(e, g, &j);
    j.done = 1;
    judge(e, &j, pc, nt);
    job_done(e, f, d, j.gen);
    if (pc->status == RES_OK)
        landed(e, how, pc, 0);
    int err = fall_back(e, f, pc, 1, how);
    if (err)
        note_primary(e, pc, 1, nt);
    return err;
}

typedef struct {
    char *buf;
    size_t len;
} request_mem_t;

static void release_buffer(void *buf) { free(buf); }

/* Late jobs keep the request's buffer (freed once they are done): a fresh one gets the bytes that
 * did land, and the pieces are read into it from now on. */
static int relocate(void *arg, piece_t *pc, size_t n, void **release_arg) {
    request_mem_t *m = arg;
    char *old = m->buf, *fresh = aligned(m->len);
    *release_arg = old;
    lose_thread_buffer(old);
    m->buf = fresh;
    if (!fresh)
        return ENOMEM;
    for (size_t i = 0; i < n; i++) {
        char *dst = fresh + (pc[i].dst - old);
        if (pc[i].status == RES_OK && pc[i].got > 0)
            memcpy(dst, pc[i].dst, (size_t)pc[i].got);
        pc[i].dst = dst;
    }
    return 0;
}

/* The asked bytes that are valid: a short piece ends them (the end of the file, or it shrank). */
static void reply_valid(fuse_req_t req, const piece_t *pc, size_t n, const char *buf, uint64_t start,
                        uint64_t off, uint64_t asked) {
    uint64_t valid = start;
    for (size_t i = 0; i < n; i++) {
        valid += (uint64_t)pc[i].got;
        if ((uint64_t)pc[i].got < pc[i].end - pc[i].start)
            break;
    }
    uint64_t end = min_u64(valid, asked);
    fuse_reply_buf(req, end > off ? buf + (off - start) : NULL, end > off ? end - off : 0);
}

/* Plan [off, asked) into runs of one drive each, read them (the mirrors' on their threads, the
 * primary's here), fall back where a mirror failed, reply. An errno if no reply was sent. */
static int read_and_reply(engine_t *e, fuse_req_t req, file_t *f, uint64_t off, uint64_t asked,
                          int primary_only, int kind, request_mem_t *mem, piece_t *pc, notes_t *nt) {
    uint64_t start = align_down_u64(off), stop = align_up_u64(asked);
    size_t n = plan_runs(e, f, start, asked, stop, off, primary_only ? PLAN_PRIMARY : 0, pc);
    for (size_t i = 0; i < n; i++)
        pc[i].dst = mem->buf + (pc[i].start - start);
    /* An O_DIRECT reader or a read call waits for this request; a page-cache reader's readahead
     * may not (it hides a slow drive's latency): only the first say which drive holds readers up. */
    int waited = kind != READ_CACHED && !primary_only && (usable(e, f) >> 1) != 0;
    reading_t how = {.abandon = relocate, .release = release_buffer, .arg = mem, .reread_timeouts = 1,
                     .count_from = off, .count_to = asked, .waited = waited, .via_cache = kind == READ_CALL};
    int err = read_pieces(e, f, pc, n, &how, nt); /* mem->buf: another one if mirror pieces timed out */
    if (!err)
        reply_valid(req, pc, n, mem->buf, start, off, asked);
    return err;
}

void serve_read(engine_t *e, fuse_req_t req, file_t *f, size_t size, off_t offset, int kind) {
    uint64_t off = (uint64_t)offset, asked = min_u64(off + size, f->size);
    if (off >= asked) {
        fuse_reply_buf(req, NULL, 0);
        return;
    }
    size_t fi = (size_t)(f - e->files);
    atomic_fetch_add(&e->ctr.file_bytes[fi], asked - off);
    atomic_fetch_add(&e->ctr.file_reads[fi], 1);
    if (kind == READ_CALL)
        atomic_fetch_add(&e->ctr.fill[18], asked - off);
    int via = kind != READ_DIRECT ? fill_serve(e, req, f, off, asked, kind == READ_CALL) : 0;
    if (via > 0)
        return; /* answered from a fill (fill.c) */
    uint64_t start = align_down_u64(off), stop = align_up_u64(asked);
    size_t cap = runs_bound(f, start, stop);
    piece_t small[REQ_BUF / BLOCK + 2];
    piece_t *pc = cap > sizeof small / sizeof *small ? malloc(cap * sizeof *pc) : small;
    request_mem_t mem = {request_buffer(stop - start), stop - start};
    notes_t nt;
    nt.n = 0;
    /* via < 0: a fill's piece failed or is late, so the primary reads it all */
    int err = pc && mem.buf ? read_and_reply(e, req, f, off, asked, via < 0, kind, &mem, pc, &nt) : ENOMEM;
    if (err)
        fuse_reply_err(req, err);
    send_notes(e, f, &nt); /* after the reply: Python takes its time */
    if (mem.buf)
        done_with(mem.buf);
    if (pc != small)
        free(pc);
}
