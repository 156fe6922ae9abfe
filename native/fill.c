/* Fills: reads ahead of page-cache readers (mmap faults, buffered reads). The kernel asks for such
 * a reader's bytes one or two requests at a time; on a drive whose every read waits its latency
 * that gets the reader a fraction of the drive, and the mirror sits idle. The first request into a
 * routed expert starts a fill: the request's own bytes and a lead of FILL_LEAD in its extent (the
 * kernel's readahead runs into experts nobody reads); once the reader asks RUN_ON_REACH away from
 * where it began, or asks lately for a page of that expert no fill reads (it read through a lead
 * whose pages were stored before it asked, onto another extent: a loader reading an expert's
 * tensors one after another), it streams, and the rest of that expert's extents in the file follow
 * (an engine reads an expert whole; at most FILL_MAX). A first request on an extent's first page,
 * or of a reader that streams through the file (STREAM_HOPS), reads the whole expert at once (no
 * lead); all less what the page cache already holds (the daemon's own view of the file, view.c)
 * and what another fill reads, cut into pieces of FILL_PIECE on the drives the routes give them
 * (the request's own on a drive clearly the quickest: it is waited for) and queued at once: up to
 * FILL_DEPTH reads in flight per drive, from every drive. Each piece, as it lands, answers the
 * kernel's requests that wait for it (the one that started the fill, or later ones whose bytes
 * the fill holds), or else is stored into the page cache (FUSE_NOTIFY_STORE): the reader's next
 * fault there finds it, without asking. A fill goes once each of its pieces was answered, stored
 * or failed. Routed experts only: an embedding table is read a few rows at a time.
 *
 * With direct reads (--direct-reads, fs.c) a read call's request starts a held fill: the calls
 * after it do not look in the page cache, so its pieces are never stored; each waits for the calls
 * that ask for its pages, and the fill expires HOLD_NS after it began: what no call asked for by
 * then is dropped (the store thread, idle, sweeps every HOLD_NS, as does every request). Its pieces
 * are read through the drives' page caches, which keep them for the next calls. A call needs no
 * lead (in a file with no O_DIRECT open): from an extent's first page it reads the whole expert,
 * from within an extent the rest of that extent (ONWARD); a call whose start a fill reads already
 * is for the key of its first byte no fill reads (it crossed into the next extent).
 *
 * Lock rules (engine.h, fills): fills.m guards the list, the queues, the arena's free units, every
 * fill's refs, left, lead, retry and expired (held and born are set before it is listed), and every
 * piece's state and asked pages. A piece's bytes are
 * written by its drive thread while it is P_READING and read (by a reply or a store) only once it
 * is P_LANDED. Stores run on a thread of their own: a store waits for the page locks of a kernel
 * request in flight over the same pages, and a request's answer waits only for drive threads,
 * which never store. A fill's memory goes with its last reference: the list's (while it has pieces
 * not done), each piece's (until done: read and then answered, stored or failed), each request
 * answering from it.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>

#define FILL_MAX (16u << 20)    /* the most a fill reads besides its request */
#define MAX_IOV 64
#define FILL_RANGES 64          /* the most extents one fill reads */
#define VIEW_PAGES 1024         /* pages looked up in the page cache at a time */
#define RUN_ON_NS (200ull * 1000000) /* a request this soon after the read it follows may run on from it */
#define RUN_ON_REACH (512u << 10)     /* the kernel's readahead runs on at most two windows (2 x 256 KiB) */
#define FILL_LEAD (1u << 20)          /* what a fill for an expert reads past its request at first */
#define HOLD_NS (100ull * 1000000)    /* a read call's fill waits this long for the calls after it */

enum { P_QUEUED, P_READING, P_LANDED, P_FAILED };

typedef struct fpiece {
    struct fill *fl;
    piece_t pc; /* start, end (BLOCK multiples), drive, dst (its unit); got once read */
    int state, urgent, done;
    uint64_t asked; /* its pages (bit i: the i-th BLOCK) a request answers: never stored */
    uint32_t unit; /* of the arena: FILL_PIECE bytes */
    uint32_t rgen; /* while P_READING: the reader generation that reads it, */
    int rdrive;    /* of this drive (pc.drive may change as it falls back to the primary) */
    struct fpiece *next; /* in its drive's queue, then in the store queue */
} fpiece_t;

typedef struct fill {
    engine_t *e;
    file_t *f;
    int refs, listed;
    size_t n, left; /* pieces; pieces not done */
    uint64_t lo, hi; /* where its pieces lie: [lo, hi) */
    int32_t key;
    uint64_t from; /* where its request began */
    int lead;      /* it reads a lead: once a reader asks RUN_ON_REACH away from `from`, the rest */
    size_t retry;  /* a lead the arena had no room to follow: tried again once it has this many free */
    int held;      /* started by a read call (direct_reads): its pieces wait for the calls after it,
                      never stored (those calls do not look in the page cache), read through the
                      drives' page caches (which keep them for the next calls), until it expires */
    int expired;   /* HOLD_NS after born: what no call asked for is dropped */
    uint64_t born;
    fpiece_t *p;    /* range by range, in plan_ranges' order */
    struct fill *next;
} fill_t;

/* -- pieces: done, queued, stored ------------------------------------------------------------- */

_Static_assert(FILL_PIECE / BLOCK == 64, "a piece's pages are the bits of a uint64_t");

/* The bits of the piece's pages that [a, b) touches (a, b: BLOCK multiples, or b the file's end). */
static uint64_t pages_in(const fpiece_t *p, uint64_t a, uint64_t b) {
    a = max_u64(a, p->pc.start);
    b = min_u64(align_up_u64(b), p->pc.end);
    if (a >= b)
        return 0;
    unsigned i = (unsigned)((a - p->pc.start) / BLOCK), j = (unsigned)((b - p->pc.start) / BLOCK);
    return (j == 64 ? ~0ull : (1ull << j) - 1) & ~((1ull << i) - 1);
}

static uint64_t pages_of(const fpiece_t *p) { return pages_in(p, p->pc.start, p->pc.end); }

static void unlist_locked(engine_t *e, fill_t *fl);

static void give_back_locked(engine_t *e, fill_t *fl) {
    for (size_t i = 0; i < fl->n; i++)
        e->fills.free_units[e->fills.nfree++] = fl->p[i].unit;
    atomic_store(&e->ctr.fill[5], (uint64_t)(e->fills.nunits - e->fills.nfree) * FILL_PIECE);
}

/* Drops a reference; the fill, if that was the last (its units back in the arena), to be freed
 * once the lock is dropped. */
static fill_t *unref_locked(engine_t *e, fill_t *fl) {
    if (--fl->refs > 0)
        return NULL;
    give_back_locked(e, fl);
    return fl;
}

static void fill_free(engine_t *e, fill_t *fl) {
    if (!fl)
        return;
    file_release(e, fl->f); /* may close descriptors: never under fills.m */
    free(fl->p);
    free(fl);
}

static fill_t *piece_done_locked(engine_t *e, fpiece_t *p) {
    fill_t *fl = p->fl;
    p->done = 1;
    if (--fl->left == 0)
        unlist_locked(e, fl); /* nothing more to answer from: its bytes are in the page cache */
    return unref_locked(e, fl);
}

static void unlist_locked(engine_t *e, fill_t *fl) {
    if (!fl->listed)
        return;
    fill_t **pp = &e->fills.list;
    while (*pp != fl)
        pp = &(*pp)->next;
    *pp = fl->next;
    fl->listed = 0;
    fill_t *last = unref_locked(e, fl); /* never the last: the caller holds one */
    (void)last;
}

static void push_locked(engine_t *e, fpiece_t *p, int urgent) {
    int d = p->pc.drive;
    p->next = NULL;
    if (urgent) {
        p->next = e->fills.head[d];
        e->fills.head[d] = p;
        if (!e->fills.tail[d])
            e->fills.tail[d] = p;
    } else {
        if (e->fills.tail[d])
            e->fills.tail[d]->next = p;
        else
            e->fills.head[d] = p;
        e->fills.tail[d] = p;
    }
    pthread_cond_signal(&e->fills.work[d]);
}

/* A queued piece a request now waits for goes to the head of its drive's queue. */
static void hurry_locked(engine_t *e, fpiece_t *p) {
    int d = p->pc.drive;
    fpiece_t **pp = &e->fills.head[d], *prev = NULL;
    while (*pp && *pp != p) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    if (!*pp || pp == &e->fills.head[d])
        return;
    *pp = p->next;
    if (e->fills.tail[d] == p)
        e->fills.tail[d] = prev;
    push_locked(e, p, 1);
}

/* -- the drive threads and the store thread ---------------------------------------------------- */

/* A piece that will not be read (the engine is closing): failed, and done. */
static fill_t *drop_locked(engine_t *e, fpiece_t *p) {
    p->state = P_FAILED;
    pthread_cond_broadcast(&e->fills.landed);
    atomic_fetch_sub(&e->queued[p->pc.drive], p->pc.end - p->pc.start);
    return piece_done_locked(e, p);
}

static void reroute_locked(engine_t *e, int d);

/* A drive reader of a generation no longer in force (fill_drive_renew): it ends. */
static int retired_locked(const engine_t *e, const fill_worker_t *w) {
    return w->drive >= 0 && w->gen != e->fills.rgen[w->drive];
}

/* A piece read by a reader generation no longer in force: one stuck in a removed mirror's drive.
 * Nobody waits for it (the request reads the primary); its bytes go nowhere but the page cache. */
static int orphaned_locked(const engine_t *e, const fpiece_t *p) {
    return p->state == P_READING && p->rdrive > 0 && p->rgen != e->fills.rgen[p->rdrive];
}

/* The bytes of a landed piece's pages no request asked for. */
static uint64_t unasked_bytes(const fpiece_t *p) {
    return (uint64_t)__builtin_popcountll(~p->asked & pages_of(p)) * BLOCK;
}

/* Read calls' fills that have waited HOLD_NS (all of them, once the fills stop): what no call asked
 * for is dropped (a call finds it in the drives' page caches), and so is what lands from now on.
 * Those whose last reference that was go into gone (at most cap; more wait for the next sweep), to
 * be freed once the lock is dropped. */
static size_t expire_locked(engine_t *e, fill_t **gone, size_t cap) {
    uint64_t now = mono_ns();
    size_t n = 0;
    for (fill_t *x = e->fills.list, *next; x && n < cap; x = next) {
        next = x->next;
        if (!x->held || x->expired || (now - x->born < HOLD_NS && !e->fills.stop))
            continue;
        x->expired = 1;
        x->refs++; /* its pieces' may be the last */
        for (size_t i = 0; i < x->n; i++) {
            fpiece_t *p = &x->p[i];
            if (p->state == P_LANDED && !p->done) {
                atomic_fetch_add(&e->ctr.fill[19], unasked_bytes(p));
                piece_done_locked(e, p); /* never the last: this sweep holds one */
            }
        }
        if ((gone[n] = unref_locked(e, x)))
            n++;
    }
    return n;
}

/* expire_locked, and the fills whose last reference that was freed (the lock dropped meanwhile):
 * whether there were any. */
static int expire_now_locked(engine_t *e) {
    fill_t *gone[MAX_IOV];
    size_t n = expire_locked(e, gone, MAX_IOV);
    if (!n)
        return 0;
    pthread_mutex_unlock(&e->fills.m);
    for (size_t i = 0; i < n; i++)
        fill_free(e, gone[i]);
    pthread_mutex_lock(&e->fills.m);
    return 1;
}

/* The time ns from now on `clock` (a condition variable's), for a timed wait. */
static struct timespec after_ns(clockid_t clock, uint64_t ns) {
    struct timespec t;
    clock_gettime(clock, &t);
    ns += (uint64_t)t.tv_nsec;
    t.tv_sec += (time_t)(ns / 1000000000ull);
    t.tv_nsec = (long)(ns % 1000000000ull);
    return t;
}

/* The store thread's wait while read calls come direct (their fills are never stored): at most
 * HOLD_NS, then it expires their fills, which no request may come to do (fill_serve). */
static void idle_locked(engine_t *e) {
    struct timespec t = after_ns(CLOCK_REALTIME, HOLD_NS); /* fills.store's clock */
    pthread_cond_timedwait(&e->fills.store, &e->fills.m, &t);
    expire_now_locked(e);
}

/* The next piece for w, or NULL once the fills stop or w's generation is retired. */
static fpiece_t *pop_locked(engine_t *e, const fill_worker_t *w) {
    int d = w->drive;
    fpiece_t **head = d < 0 ? &e->fills.store_head : &e->fills.head[d];
    fpiece_t **tail = d < 0 ? &e->fills.store_tail : &e->fills.tail[d];
    pthread_cond_t *c = d < 0 ? &e->fills.store : &e->fills.work[d];
    while (!*head && !e->fills.stop && !retired_locked(e, w)) {
        if (d < 0 && e->direct_reads) /* asked for (reads_direct: once INIT is answered) */
            idle_locked(e);
        else
            pthread_cond_wait(c, &e->fills.m);
    }
    if (retired_locked(e, w))
        return NULL; /* what is queued is the new generation's */
    fpiece_t *p = *head;
    if (p) {
        *head = p->next;
        if (!*head)
            *tail = NULL;
    }
    return p;
}

/* A piece just read (fills.m held): it waits for the read calls after the one that started its fill
 * (held: answer_locked), goes to the store thread (the pages no request asked for, while the fills
 * run), or is done; the fill, if that was its last reference. */
static fill_t *landed_locked(engine_t *e, fpiece_t *p) {
    fill_t *fl = p->fl;
    int unasked = p->state == P_LANDED && (~p->asked & pages_of(p)) && !e->fills.stop;
    if (unasked && fl->held && !fl->expired)
        return NULL;
    if (unasked && !fl->held) {
        p->next = NULL;
        if (e->fills.store_tail)
            e->fills.store_tail->next = p;
        else
            e->fills.store_head = p;
        e->fills.store_tail = p;
        pthread_cond_signal(&e->fills.store);
        return NULL;
    }
    if (p->state == P_LANDED && fl->held) /* expired: what no call asked for is dropped */
        atomic_fetch_add(&e->ctr.fill[19], unasked_bytes(p));
    return piece_done_locked(e, p);
}

/* Read one piece on this thread (a mirror's checked, and read again from the primary if it
 * failed), then hand it to whoever waits for it, or to the store thread. */
static void read_one(engine_t *e, fpiece_t *p) {
    fill_t *fl = p->fl;
    file_t *f = fl->f; /* of e->files: it outlives the fill, which may be gone once the piece is handed on */
    notes_t nt;
    nt.n = 0;
    reading_t how = {.count_from = p->pc.start, .count_to = p->pc.end, .via_cache = fl->held};
    int err = read_piece_here(e, f, &p->pc, &how, &nt);
    uint64_t want = min_u64(p->pc.end, f->size) - p->pc.start;
    pthread_mutex_lock(&e->fills.m);
    p->state = !err && (uint64_t)p->pc.got == want ? P_LANDED : P_FAILED;
    if (p->state == P_FAILED)
        atomic_fetch_add(&e->ctr.fill[14], p->pc.end - p->pc.start);
    pthread_cond_broadcast(&e->fills.landed);
    fill_t *gone = landed_locked(e, p);
    pthread_mutex_unlock(&e->fills.m);
    send_notes(e, f, &nt); /* not fl->f: a stored piece's fill may be freed by now */
    fill_free(e, gone);
}

/* Bytes [a, b) of the piece into the page cache. */
static void store_range(engine_t *e, fpiece_t *p, uint64_t a, uint64_t b) {
    struct fuse_bufvec bv = FUSE_BUFVEC_INIT((size_t)(b - a));
    bv.buf[0].mem = p->pc.dst + (a - p->pc.start);
    int err = fuse_lowlevel_notify_store(e->se, p->fl->f->ino, (off_t)a, &bv, 0);
    if (!err) {
        atomic_fetch_add(&e->ctr.fill[7], b - a);
    } else {
        atomic_fetch_add(&e->ctr.fill[11], b - a);
        atomic_store(&e->ctr.fill[12], (uint64_t)-err);
    }
}

/* The piece's pages no request answers, into the page cache, in runs. No store once the loop is
 * told to stop (fill_quiesce): a store waits for the page locks of a request in flight, which only
 * a FUSE worker answers. */
static void store_one(engine_t *e, fpiece_t *p) {
    pthread_mutex_lock(&e->fills.m);
    uint64_t asked = e->fills.stop || e->fills.no_store ? ~0ull : p->asked;
    e->fills.storing = 1;
    pthread_mutex_unlock(&e->fills.m);
    uint64_t end = p->pc.start + (uint64_t)p->pc.got;
    for (unsigned i = 0; p->pc.start + (uint64_t)i * BLOCK < end;) {
        if (asked >> i & 1) {
            i++;
            continue;
        }
        unsigned j = i;
        while (p->pc.start + (uint64_t)j * BLOCK < end && !(asked >> j & 1))
            j++;
        store_range(e, p, p->pc.start + (uint64_t)i * BLOCK, min_u64(p->pc.start + (uint64_t)j * BLOCK, end));
        i = j;
    }
    pthread_mutex_lock(&e->fills.m);
    e->fills.storing = 0;
    pthread_cond_broadcast(&e->fills.stored);
    fill_t *gone = piece_done_locked(e, p);
    pthread_mutex_unlock(&e->fills.m);
    fill_free(e, gone);
}

static void *worker_main(void *arg) {
    fill_worker_t *w = arg;
    engine_t *e = w->e;
    int d = w->drive;
    for (;;) {
        pthread_mutex_lock(&e->fills.m);
        fpiece_t *p = pop_locked(e, w);
        int closing = p && d >= 0 && e->fills.stop; /* its bytes could go nowhere: not read */
        fill_t *gone = closing ? drop_locked(e, p) : NULL;
        if (p && d >= 0 && !closing) {
            p->state = P_READING;
            p->rgen = w->gen;
            p->rdrive = d;
        }
        pthread_mutex_unlock(&e->fills.m);
        if (!p)
            return NULL;
        if (closing) {
            fill_free(e, gone);
            continue;
        }
        if (d < 0)
            store_one(e, p);
        else
            read_one(e, p);
    }
}

/* One more worker, of the drive's reader generation in force (a reader: counted in readers).
 * Only the Python thread starts, renews and stops workers: rgen cannot move meanwhile. */
static int start_worker(engine_t *e, int drive) {
    fill_worker_t *w = calloc(1, sizeof *w);
    if (!w)
        return ENOMEM;
    w->e = e;
    w->drive = drive;
    pthread_mutex_lock(&e->fills.m);
    w->gen = drive >= 0 ? e->fills.rgen[drive] : 0;
    pthread_mutex_unlock(&e->fills.m);
    int err = pthread_create(&w->thread, NULL, worker_main, w);
    if (err) {
        free(w);
        return err;
    }
    pthread_mutex_lock(&e->fills.m);
    w->next = e->fills.workers;
    e->fills.workers = w;
    e->fills.nworkers++;
    if (drive >= 0)
        e->fills.readers[drive]++;
    pthread_mutex_unlock(&e->fills.m);
    return 0;
}

/* Readers of retired generations that have ended, joined and forgotten (a stuck one is kept). */
static void reap_locked(engine_t *e) {
    for (fill_worker_t **pw = &e->fills.workers, *w; (w = *pw);) {
        if (retired_locked(e, w) && pthread_tryjoin_np(w->thread, NULL) == 0) {
            *pw = w->next;
            e->fills.nworkers--;
            free(w);
        } else {
            pw = &w->next;
        }
    }
}

int fill_drive_start(engine_t *e, int d) {
    if (!e->fills.budget)
        return 0;
    int err = 0;
    for (int t = 0; t < FILL_DEPTH && !err; t++)
        err = start_worker(e, d);
    return err;
}

int fill_drive_renew(engine_t *e, int d) {
    if (!e->fills.budget)
        return 0;
    pthread_mutex_lock(&e->fills.m);
    e->fills.rgen[d]++;
    e->fills.readers[d] = 0; /* until the new ones start, its pieces are the primary's */
    pthread_cond_broadcast(&e->fills.work[d]);
    pthread_cond_broadcast(&e->fills.landed); /* who waits for an orphaned piece stops waiting */
    reap_locked(e);
    pthread_mutex_unlock(&e->fills.m);
    int err = fill_drive_start(e, d);
    pthread_mutex_lock(&e->fills.m);
    if (!e->fills.readers[d]) /* none started: what it queues is the primary's */
        reroute_locked(e, d);
    pthread_mutex_unlock(&e->fills.m);
    return err;
}

int fills_start(engine_t *e) {
    if (!e->fills.budget)
        return 0;
    int err = start_worker(e, -1);
    for (int d = 0; !err && d < e->nrep; d++)
        err = fill_drive_start(e, d);
    return err;
}

void fill_quiesce(engine_t *e) {
    if (!e->fills.nworkers)
        return;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += 5;
    pthread_mutex_lock(&e->fills.m);
    e->fills.no_store = 1;
    while (e->fills.storing && pthread_cond_timedwait(&e->fills.stored, &e->fills.m, &deadline) == 0)
        ;
    pthread_mutex_unlock(&e->fills.m);
}

/* The workers end once their queues are empty; one stuck in a read on a hung drive is detached
 * (what it reads into stays allocated, and so does its fill). */
void fills_stop(engine_t *e) {
    if (!e->fills.nworkers)
        return;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    pthread_mutex_lock(&e->fills.m);
    e->fills.stop = 1;
    for (int d = 0; d < MAX_REPLICAS; d++)
        pthread_cond_broadcast(&e->fills.work[d]);
    pthread_cond_broadcast(&e->fills.store);
    fill_worker_t *w = e->fills.workers;
    e->fills.workers = NULL;
    pthread_mutex_unlock(&e->fills.m);
    while (w) {
        fill_worker_t *next = w->next;
        if (pthread_timedjoin_np(w->thread, NULL, &deadline) == 0) {
            free(w);
        } else { /* it still uses w */
            pthread_detach(w->thread);
            e->threads_left = 1;
        }
        w = next;
    }
    e->fills.nworkers = 0;
    pthread_mutex_lock(&e->fills.m); /* read calls' fills still waiting for calls: none will come */
    while (e->fills.list && expire_now_locked(e))
        ;
    pthread_mutex_unlock(&e->fills.m);
}

/* No new fills while memory is short, and the arena's unused units go back to the system. */
void fill_pause(engine_t *e, int paused) {
    atomic_store(&e->fills.paused, paused);
    if (!paused || !e->fills.nunits)
        return;
    pthread_mutex_lock(&e->fills.m);
    for (size_t i = 0; i < e->fills.nfree; i++)
        madvise(e->fills.arena + (size_t)e->fills.free_units[i] * FILL_PIECE, FILL_PIECE, MADV_DONTNEED);
    pthread_mutex_unlock(&e->fills.m);
}

static int by_key(const void *x, const void *y, void *arg) {
    const file_t *f = arg;
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    int32_t ka = f->seg_key[a], kb = f->seg_key[b];
    if (ka != kb)
        return ka < kb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* Each file's routed-expert segments sorted by key (what a fill looks its extents up in). */
static int index_experts(engine_t *e, file_t *f) {
    size_t n = 0;
    for (uint32_t i = 0; i < f->nseg; i++)
        n += f->seg_key[i] >= 0 && e->key_expert[f->seg_key[i]];
    if (!n)
        return 0;
    f->expert_seg = malloc(n * sizeof *f->expert_seg);
    if (!f->expert_seg)
        return ENOMEM;
    for (uint32_t i = 0; i < f->nseg; i++)
        if (f->seg_key[i] >= 0 && e->key_expert[f->seg_key[i]])
            f->expert_seg[f->nexpert++] = i;
    qsort_r(f->expert_seg, n, sizeof *f->expert_seg, by_key, f);
    return 0;
}

/* The arena, mapped once: its pages are touched once and stay the daemon's (a fill's memory from
 * malloc would grow every thread's heap). */
static int map_arena(engine_t *e, size_t units) {
    void *a = mmap(NULL, units * FILL_PIECE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    e->fills.free_units = malloc(units * sizeof(uint32_t));
    if (a == MAP_FAILED || !e->fills.free_units) {
        if (a != MAP_FAILED)
            munmap(a, units * FILL_PIECE);
        return ENOMEM;
    }
    for (size_t i = 0; i < units; i++) /* a stack: the units used last are used again (warm) */
        e->fills.free_units[i] = (uint32_t)(units - 1 - i);
    e->fills.arena = a;
    e->fills.nunits = e->fills.nfree = units;
    return 0;
}

int fill_init(engine_t *e, size_t budget) {
    pthread_mutex_init(&e->fills.m, NULL);
    pthread_condattr_t mono; /* a request's deadline is on the monotonic clock (wait_landed_locked) */
    pthread_condattr_init(&mono);
    pthread_condattr_setclock(&mono, CLOCK_MONOTONIC);
    pthread_cond_init(&e->fills.landed, &mono);
    pthread_cond_init(&e->fills.stored, &mono);
    pthread_condattr_destroy(&mono);
    pthread_cond_init(&e->fills.store, NULL);
    for (int d = 0; d < MAX_REPLICAS; d++)
        pthread_cond_init(&e->fills.work[d], NULL);
    for (size_t i = 0; i < e->nnodes; i++)
        if (e->nodes[i].file >= 0)
            e->files[e->nodes[i].file].ino = e->nodes[i].ino;
    e->fills.budget = budget / FILL_PIECE * FILL_PIECE;
    if (!e->fills.budget)
        return 0;
    for (size_t i = 0; i < e->nfiles; i++)
        if (index_experts(e, &e->files[i]))
            return ENOMEM;
    return map_arena(e, e->fills.budget / FILL_PIECE);
}

/* After the loop. Units a fill stuck on a hung mirror holds are written by its detached thread:
 * then the arena stays, to the exit. */
void fill_free_arena(engine_t *e) {
    if (!e->fills.arena || e->fills.nfree != e->fills.nunits)
        return;
    munmap(e->fills.arena, e->fills.nunits * FILL_PIECE);
    free(e->fills.free_units);
    e->fills.arena = NULL;
    e->fills.free_units = NULL;
}

/* -- planning a fill ----------------------------------------------------------------------------- */

typedef struct {
    uint64_t a[2 * FILL_RANGES], b[2 * FILL_RANGES];
    size_t n;
    uint64_t total, cap;
    int lead;
} ranges_t;

static void append_range(ranges_t *r, uint64_t a, uint64_t b) {
    if (a >= b || r->n == 2 * FILL_RANGES || r->total >= r->cap)
        return;
    b = min_u64(b, a + (r->cap - r->total));
    r->a[r->n] = a;
    r->b[r->n++] = b;
    r->total += b - a;
}

/* [a, b) less what the listed fills of f read already, appended while under the cap. */
static void add_range(engine_t *e, file_t *f, ranges_t *r, uint64_t a, uint64_t b) {
    for (fill_t *x = e->fills.list; x && a < b; x = x->next) {
        if (x->f != f || x->hi <= a || x->lo >= b)
            continue;
        for (size_t i = 0; i < x->n && a < b; i++) {
            const piece_t *p = &x->p[i].pc;
            if (p->end <= a || p->start >= b)
                continue;
            if (p->start > a) /* the part before the other fill's piece, then what follows it */
                add_range(e, f, r, a, p->start);
            a = p->end;
        }
    }
    append_range(r, a, b);
}

/* [a, b) less the pages the page cache holds (view.c), added to r. */
static void view_missing(engine_t *e, file_t *f, uint64_t a, uint64_t b, ranges_t *r) {
    unsigned char vec[VIEW_PAGES];
    while (a < b) {
        uint64_t end = min_u64(b, a + (uint64_t)VIEW_PAGES * BLOCK), seen = a;
        size_t n = view_cached(f, a, end, vec);
        for (size_t i = 0, j; i < n; i = j) {
            for (j = i; j < n && (vec[j] & 1) == (vec[i] & 1); j++)
                ;
            uint64_t s = a + i * BLOCK, t = min_u64(a + j * BLOCK, end);
            if (vec[i] & 1)
                atomic_fetch_add(&e->ctr.fill[8], t - s);
            else
                add_range(e, f, r, s, t);
            seen = t;
        }
        add_range(e, f, r, seen, end); /* no view, or past what it maps */
        a = end;
    }
}

/* The key's extents in f, in file order, each [a, b): at most cap. */
static size_t key_extents(const file_t *f, int32_t k, uint64_t *a, uint64_t *b, size_t cap) {
    size_t n = 0, lo = 0, hi = f->nexpert;
    while (lo < hi) { /* the first of the key's segments */
        size_t mid = lo + (hi - lo) / 2;
        if (f->seg_key[f->expert_seg[mid]] < k)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = lo; i < f->nexpert && f->seg_key[f->expert_seg[i]] == k; i++) {
        uint32_t s = f->expert_seg[i];
        uint64_t end = s + 1 < f->nseg ? f->seg_start[s + 1] : f->size;
        if (n && b[n - 1] == f->seg_start[s]) {
            b[n - 1] = end; /* neighbouring segments of one extent */
        } else if (n < cap) {
            a[n] = f->seg_start[s];
            b[n++] = end;
        }
    }
    return n;
}

static int is_expert(const engine_t *e, int32_t k) { return k >= 0 && e->key_expert[k]; }

/* Where the run of segments of one key that holds `at` ends: that tensor's end. */
static uint64_t run_end(const file_t *f, uint64_t at) {
    uint32_t s = segment_at(f, at);
    while (s + 1 < f->nseg && f->seg_key[s + 1] == f->seg_key[s])
        s++;
    return s + 1 < f->nseg ? f->seg_start[s + 1] : f->size;
}

/* The extent of key k's extents a[], b[] (n) that holds off, or the first after it: n if none. */
static size_t extent_of(const uint64_t *b, size_t n, uint64_t off) {
    size_t i = 0;
    while (i < n && b[i] <= off)
        i++;
    return i;
}

/* How a fill for an expert reads it: a lead (not streamed yet), or the rest of it (a reader read
 * through a lead, or came back to the expert where no fill reads, or began on an extent's first
 * page, or streams through the file: IN_STREAM), or, for a read call into an extent mid-way,
 * only the rest of that extent (ONWARD: what an engine reads into its buffer it reads to the end of
 * the extent, and a reader reading a file through reaches the key's other extents much later). */
enum { NOT_STREAMED, PAST_A_LEAD, FROM_FIRST_PAGE, ONWARD, IN_STREAM };

/* What a fill for a request [off, asked) into key k reads, all less what the page cache holds and
 * what other fills read. Any other tensor a reader streams (each request starting where the last
 * one ended): the request's bytes and the next FILL_MAX of the tensor. A routed expert: the
 * request's bytes and a lead of FILL_LEAD of its extent (after the request, what is short of it
 * before), until the reader shows it streams (the kernel's readahead runs past an extent into the
 * next expert, which nobody may want: two windows at most, so a reader RUN_ON_REACH into an extent
 * wants it; so does one that begins on the extent's first page, one that comes back to the expert
 * where no fill reads, and one that streams through the file: `streams`); then the rest of
 * the extent, the key's extents after it, those before it, and last the part of its own extent
 * before the request (a reader streams forwards, mostly). Of a file also open with O_DIRECT only
 * the extent asked: such an engine reads the expert's weights direct and some of its tensors
 * (scales) through the page cache (Colibri's DIRECT=1). ONWARD: the rest of the extent asked. */
static void plan_ranges(engine_t *e, file_t *f, int32_t k, uint64_t off, uint64_t asked, int streams,
                        ranges_t *r) {
    uint64_t a[FILL_RANGES], b[FILL_RANGES];
    uint64_t head = align_down_u64(off), tail = align_up_u64(asked);
    r->n = 0;
    r->total = 0;
    r->lead = 0;
    r->cap = FILL_MAX + (tail - head);
    add_range(e, f, r, head, tail);
    if (!is_expert(e, k)) {
        view_missing(e, f, tail, align_up_u64(min_u64(run_end(f, asked - 1), tail + FILL_MAX)), r);
        return;
    }
    size_t n = key_extents(f, k, a, b, FILL_RANGES), first = extent_of(b, n, off);
    if (first == n)
        return;
    if (!streams) {
        uint64_t end = max_u64(tail, min_u64(align_up_u64(b[first]), tail + FILL_LEAD));
        uint64_t lo = align_down_u64(a[first]), room = FILL_LEAD - (end - tail);
        view_missing(e, f, tail, end, r);
        view_missing(e, f, head > lo + room ? head - room : min_u64(lo, head), head, r);
        r->lead = 1;
        return;
    }
    size_t whole = atomic_load(&f->direct_opens) || streams == ONWARD ? 1 : n;
    for (size_t j = 0; j < whole; j++) {
        size_t i = (first + j) % n;
        view_missing(e, f, j ? align_down_u64(a[i]) : tail, align_up_u64(b[i]), r);
    }
    if (streams != ONWARD)
        view_missing(e, f, align_down_u64(a[first]), head, r);
}

/* Whether [a, b) is all in the page cache (a, b: BLOCK multiples, b - a at most RUN_ON_REACH). */
static int all_cached(file_t *f, uint64_t a, uint64_t b) {
    unsigned char vec[RUN_ON_REACH / BLOCK];
    size_t got = view_cached(f, a, b, vec);
    for (size_t j = 0; j < got; j++)
        if (!(vec[j] & 1))
            return 0;
    return got && got == (b - a) / BLOCK;
}

/* Whether a reader streams through key k's extent at [off, asked), and how: it begins on the
 * extent's first page (FROM_FIRST_PAGE: an engine reading the expert, a buffered read of it or a
 * fault at its first byte, which wants it whole; the kernel's readahead running into it runs on
 * from a read of another key, which starts no fill, intent_locked, and a fault's read-around
 * reaches into it from the page of that fault), or the RUN_ON_REACH of that extent before it (or
 * after it: a reader going backwards) is in the page cache, a lead it read through (PAST_A_LEAD). */
static int streamed(engine_t *e, file_t *f, int32_t k, uint64_t off, uint64_t asked) {
    uint64_t a[FILL_RANGES], b[FILL_RANGES];
    size_t n = is_expert(e, k) ? key_extents(f, k, a, b, FILL_RANGES) : 0, i = extent_of(b, n, off);
    uint64_t head = align_down_u64(off), tail = align_up_u64(asked);
    if (i == n)
        return NOT_STREAMED;
    if (head == align_down_u64(a[i]))
        return FROM_FIRST_PAGE;
    return (head >= a[i] + RUN_ON_REACH && all_cached(f, head - RUN_ON_REACH, head)) ||
                   (tail + RUN_ON_REACH <= b[i] && all_cached(f, tail, tail + RUN_ON_REACH))
               ? PAST_A_LEAD
               : NOT_STREAMED;
}

/* The pieces of the ranges, on the drives the routes give them (the primary where a drive has no
 * fill threads), at most FILL_PIECE each, in fl->p (dst not set yet). */
static int cut(engine_t *e, fill_t *fl, const ranges_t *r) {
    size_t cap = 0;
    for (size_t i = 0; i < r->n; i++)
        cap += runs_bound(fl->f, r->a[i], r->b[i]) + (r->b[i] - r->a[i]) / FILL_PIECE + 1;
    piece_t *runs = malloc(cap * sizeof *runs);
    fl->p = calloc(cap, sizeof *fl->p);
    if (!runs || !fl->p) {
        free(runs);
        return 0;
    }
    for (size_t i = 0; i < r->n; i++) {
        size_t nr = plan_runs(e, fl->f, r->a[i], r->b[i], r->b[i], r->a[i], PLAN_KEYS_LATER, runs);
        for (size_t j = 0; j < nr; j++) {
            int d = e->fills.readers[runs[j].drive] ? runs[j].drive : 0;
            for (uint64_t x = runs[j].start; x < runs[j].end;) {
                uint64_t y = min_u64(runs[j].end, x + FILL_PIECE);
                fl->p[fl->n++] = (fpiece_t){.fl = fl, .pc = {.start = x, .end = y, .drive = d}};
                fl->lo = fl->n == 1 ? x : min_u64(fl->lo, x);
                fl->hi = max_u64(fl->hi, y);
                x = y;
            }
        }
    }
    free(runs);
    return 1;
}

/* A unit of the arena for each piece, if there are enough. */
static int take_units_locked(engine_t *e, fill_t *fl) {
    if (fl->n > e->fills.nfree)
        return 0;
    for (size_t i = 0; i < fl->n; i++) {
        fl->p[i].unit = e->fills.free_units[--e->fills.nfree];
        fl->p[i].pc.dst = e->fills.arena + (size_t)fl->p[i].unit * FILL_PIECE;
    }
    atomic_store(&e->ctr.fill[5], (uint64_t)(e->fills.nunits - e->fills.nfree) * FILL_PIECE);
    return 1;
}

/* Where f's first tensor begins: the header before it is the primary's, whatever reads it. */
static uint64_t first_tensor(const file_t *f) {
    uint32_t i = 0;
    while (i < f->nseg && f->seg_key[i] < 0)
        i++;
    return i < f->nseg ? f->seg_start[i] : f->size;
}

/* The fill's pieces into their drives' queues: the request's own first (it waits for them), on the
 * quickest drive if one is clearly quicker; the rest behind. Each piece counted for its keys on the
 * drive that reads it. */
static void queue_locked(engine_t *e, fill_t *fl, uint64_t off, uint64_t asked) {
    uint64_t head = align_down_u64(off), tail = align_up_u64(asked), data = first_tensor(fl->f);
    int quick = -2; /* not asked yet */
    int32_t last_key = -1;
    for (size_t j = 0; j < fl->n; j++) {
        fpiece_t *p = &fl->p[j];
        p->urgent = p->pc.start < tail && p->pc.end > head;
        if (p->urgent && quick == -2)
            quick = quickest_drive(e, fl->f);
        if (p->urgent && quick >= 0 && e->fills.readers[quick] && p->pc.start >= data)
            p->pc.drive = quick;
        count_span(e, fl->f, p->pc.start, p->pc.end, p->pc.drive, &last_key);
        atomic_fetch_add(&e->queued[p->pc.drive], p->pc.end - p->pc.start);
        if (!p->urgent)
            push_locked(e, p, 0);
    }
    for (size_t j = fl->n; j-- > 0;) /* backwards: the request's own reach the queues' heads in order */
        if (fl->p[j].urgent)
            push_locked(e, &fl->p[j], 1);
}

/* A new fill for a request into key k's extent, listed, its pieces queued; or NULL (*spent, if
 * given: set when the arena had too few units for it). */
static fill_t *start_locked(engine_t *e, file_t *f, int32_t k, uint64_t off, uint64_t asked, int streams, int held,
                            int *spent) {
    ranges_t *r = malloc(sizeof *r);
    fill_t *fl = calloc(1, sizeof *fl);
    if (!r || !fl) {
        free(r);
        free(fl);
        return NULL;
    }
    plan_ranges(e, f, k, off, asked, streams, r);
    *fl = (fill_t){.e = e, .f = f, .key = k, .from = align_down_u64(off), .lead = r->lead, .held = held,
                   .born = mono_ns()};
    int ok = r->n && cut(e, fl, r);
    uint64_t bytes = r->total;
    free(r);
    if (ok && !take_units_locked(e, fl)) {
        atomic_fetch_add(&e->ctr.fill[6], 1);
        if (spent)
            *spent = 1;
        ok = 0;
    }
    if (!ok || file_open(e, f) != 0) { /* the request's own open holds it: nothing is opened */
        if (ok)
            give_back_locked(e, fl);
        free(fl->p);
        free(fl);
        return NULL;
    }
    atomic_fetch_add(&e->ctr.fill[0], 1);
    atomic_fetch_add(&e->ctr.fill[1], bytes);
    fl->left = fl->n;
    fl->refs = (int)fl->n + 1; /* each piece's and the list's */
    fl->listed = 1;
    fl->next = e->fills.list;
    e->fills.list = fl;
    queue_locked(e, fl, off, asked);
    return fl;
}

/* -- answering a request from a fill --------------------------------------------------------------- */

/* The piece of a listed fill of f that holds byte `at`, or NULL (listed fills' pieces never overlap:
 * add_range). */
static fpiece_t *piece_at_locked(engine_t *e, const file_t *f, uint64_t at) {
    for (fill_t *x = e->fills.list; x; x = x->next)
        for (size_t i = 0; x->f == f && x->lo <= at && at < x->hi && i < x->n; i++)
            if (x->p[i].pc.start <= at && at < x->p[i].pc.end)
                return &x->p[i];
    return NULL;
}

/* The pieces of f's listed fills over [off, asked), in file order, if they cover it all (a request
 * may span two fills: a lead and the fill it grew into, two experts' leads, a read call's fill and
 * the fill that reads its start); their count, or 0. */
static size_t covering_locked(engine_t *e, const file_t *f, uint64_t off, uint64_t asked, fpiece_t **out) {
    size_t n = 0;
    for (uint64_t at = off; at < asked;) {
        fpiece_t *hit = piece_at_locked(e, f, at);
        if (!hit || n == MAX_IOV)
            return 0;
        out[n++] = hit;
        at = hit->pc.end;
    }
    return n;
}

/* Whether a listed fill of f reads any byte of [off, asked). */
static int overlaps_locked(engine_t *e, file_t *f, uint64_t off, uint64_t asked) {
    for (fill_t *x = e->fills.list; x; x = x->next)
        for (size_t i = 0; x->f == f && x->lo < asked && off < x->hi && i < x->n; i++)
            if (x->p[i].pc.start < asked && off < x->p[i].pc.end)
                return 1;
    return 0;
}

static int wait_landed_locked(engine_t *e, fpiece_t **ps, size_t n, int *waited) {
    struct timespec deadline = {0};
    if (e->mirror_timeout > 0)
        deadline = after_ns(CLOCK_MONOTONIC, (uint64_t)(e->mirror_timeout * 1e9)); /* fills.landed's */
    for (;;) {
        int pending = 0;
        for (size_t i = 0; i < n; i++) {
            if (ps[i]->state == P_FAILED || orphaned_locked(e, ps[i]))
                return -1;
            pending |= ps[i]->state != P_LANDED;
        }
        if (!pending)
            return 1;
        *waited = 1;
        if (e->mirror_timeout <= 0)
            pthread_cond_wait(&e->fills.landed, &e->fills.m);
        else if (pthread_cond_timedwait(&e->fills.landed, &e->fills.m, &deadline) == ETIMEDOUT)
            return -2; /* a hung drive: the request reads the primary itself */
    }
}

static void reply_from(fuse_req_t req, fpiece_t **ps, size_t n, uint64_t off, uint64_t asked) {
    struct iovec iov[MAX_IOV];
    for (size_t i = 0; i < n; i++) {
        uint64_t a = max_u64(off, ps[i]->pc.start), b = min_u64(asked, ps[i]->pc.end);
        iov[i].iov_base = ps[i]->pc.dst + (a - ps[i]->pc.start);
        iov[i].iov_len = b - a;
    }
    fuse_reply_iov(req, iov, (int)n);
}

/* The pieces queued on mirror d, to the primary's queue: d gave a request no answer in time, and
 * what waits behind it there would wait as long. */
static void reroute_locked(engine_t *e, int d) {
    for (fpiece_t *p = e->fills.head[d], *next; p; p = next) {
        next = p->next;
        uint64_t len = p->pc.end - p->pc.start;
        atomic_fetch_sub(&e->queued[d], len);
        atomic_fetch_add(&e->queued[0], len);
        p->pc.drive = 0;
        push_locked(e, p, p->urgent);
    }
    e->fills.head[d] = e->fills.tail[d] = NULL;
}

/* A request gave up waiting for these pieces: the mirrors they wait on are noted (health counts the
 * timeout) and their queues go to the primary. */
static void late_locked(engine_t *e, fpiece_t **ps, size_t n, notes_t *nt) {
    for (size_t i = 0; i < n; i++) {
        int d = ps[i]->pc.drive;
        if (d && (ps[i]->state == P_QUEUED || ps[i]->state == P_READING) && !orphaned_locked(e, ps[i])) {
            note_timeout(e, nt, d, ps[i]->pc.start);
            reroute_locked(e, d);
        }
    }
}

/* Called with the lock held; releases it. 1: answered; -1: a piece failed or is late. The request
 * holds a reference to each piece's fill while it waits and replies. */
static int answer_locked(engine_t *e, file_t *f, fuse_req_t req, uint64_t off, uint64_t asked, fpiece_t **ps,
                         size_t n) {
    for (size_t i = 0; i < n; i++) {
        ps[i]->fl->refs++;
        ps[i]->asked |= pages_in(ps[i], off, asked);
        if (ps[i]->state == P_QUEUED)
            hurry_locked(e, ps[i]);
    }
    int waited = 0;
    int st = wait_landed_locked(e, ps, n, &waited);
    notes_t nt;
    nt.n = 0;
    if (st == -2)
        late_locked(e, ps, n, &nt);
    pthread_mutex_unlock(&e->fills.m);
    if (st < 0)
        atomic_fetch_add(&e->ctr.fill[13], 1);
    if (st > 0) {
        reply_from(req, ps, n, off, asked);
        atomic_fetch_add(&e->ctr.fill[2], 1);
        atomic_fetch_add(&e->ctr.fill[3], (uint64_t)waited);
        atomic_fetch_add(&e->ctr.fill[4], asked - off);
    }
    send_notes(e, f, &nt);
    fill_t *gone[MAX_IOV];
    size_t ngone = 0;
    pthread_mutex_lock(&e->fills.m);
    for (size_t i = 0; i < n; i++) { /* a fill's last reference is its last piece's here */
        fpiece_t *p = ps[i];
        if (p->fl->held && p->state == P_LANDED && !p->done && !(~p->asked & pages_of(p)))
            piece_done_locked(e, p); /* held, and every page asked for now: never the last (ours) */
        if ((gone[ngone] = unref_locked(e, p->fl)))
            ngone++;
    }
    pthread_mutex_unlock(&e->fills.m);
    for (size_t i = 0; i < ngone; i++)
        fill_free(e, gone[i]);
    return st < 0 ? -1 : st;
}

/* -- which expert a request is for ----------------------------------------------------------------
 *
 * A fill reads a lead of an expert, so it must start only for an expert the engine reads, and the
 * kernel asks for more than that. A fault's read-around is centred on the faulting page: for a fault at an
 * expert's first byte, half of it lies in the extent before (sent as a request of its own when the
 * kernel splits it: one that ends on the page where the expert begins). And the kernel's readahead
 * runs on past the end of an extent an engine streams, up to two windows into the next one, which
 * nobody may want. So a request is for the key at its middle, or for the expert that begins on the
 * page after it; but one that starts where a read of another key lately ended runs on from that
 * read, until it is RUN_ON_REACH past where the run-on began (then the engine reads on: it wants
 * this key too). Requests that start no fill are remembered under the key they run on from, so a
 * run-on is followed window by window. A reader that streams on across STREAM_HOPS boundaries
 * between experts (a load reading the file through) wants each next key whole from its first
 * request: no run-on, no lead (at worst a fill of a whole expert nobody reads, where an engine's
 * readahead runs on past three experts it read back to back). A read call
 * (--direct-reads) is what the engine asked for, never the kernel's readahead: it never runs on,
 * and is remembered as a stream (a request of the page cache that begins where it ended is no
 * readahead running on from it either). */

#define STREAM_HOPS 3

typedef struct {
    int32_t key;    /* the key the request is for (-1: plain bytes, a header) */
    int run_on;     /* it runs on from a read of `origin`, begun at `from`: for no key */
    int32_t origin;
    uint64_t from;
    uint32_t hops; /* the boundaries between experts the reader crossed streaming up to it */
} intent_t;

static int32_t key_at(const file_t *f, uint64_t off) { return f->seg_key[segment_at(f, off)]; }


/* Whether r is a read remembered lately (RUN_ON_NS). */
static int lately(const recent_t *r, uint64_t now) { return r->t && now - r->t < RUN_ON_NS; }

/* Whether r is a read lately that reaches off: it ends there or past it. */
static int reaches_lately(const recent_t *r, uint64_t off, uint64_t now) {
    return lately(r, now) && r->lo < off && off <= r->hi;
}

/* The latest read of f lately, of a key other than k, that ends where off begins, or NULL. */
static const recent_t *read_before_locked(const file_t *f, uint64_t off, int32_t k, uint64_t now) {
    const recent_t *latest = NULL;
    for (size_t i = 0; i < FILL_RECENT; i++) {
        const recent_t *r = &f->recent[i];
        if (r->key != k && reaches_lately(r, off, now) && (!latest || r->t > latest->t))
            latest = r;
    }
    return latest;
}

/* The boundaries crossed by the stream that a read of key k lately, ending at or past off, belongs to. */
static uint32_t hops_within_locked(const file_t *f, uint64_t off, int32_t k, uint64_t now) {
    uint32_t hops = 0;
    for (size_t i = 0; i < FILL_RECENT; i++) {
        const recent_t *r = &f->recent[i];
        if (r->key == k && reaches_lately(r, off, now) && r->hops > hops)
            hops = r->hops;
    }
    return hops;
}

/* The first byte of [off, asked) no listed fill of f reads (asked: all of it is read). */
static uint64_t uncovered_locked(engine_t *e, const file_t *f, uint64_t off, uint64_t asked) {
    for (fpiece_t *p; off < asked && (p = piece_at_locked(e, f, off));)
        off = p->pc.end;
    return min_u64(off, asked);
}

/* The key a request [off, asked) (BLOCK multiples) is for. A read call's that a fill reads the start
 * of: the key of its first byte no fill reads (it crossed into the next expert). */
static intent_t intent_locked(engine_t *e, const file_t *f, uint64_t off, uint64_t asked, int call,
                              uint64_t now) {
    int32_t k = key_at(f, off + (asked - off) / 2);
    if (call) {
        uint64_t at = uncovered_locked(e, f, off, asked);
        return (intent_t){.key = at > off ? key_at(f, min_u64(at, asked - 1)) : k, .hops = STREAM_HOPS};
    }
    if (asked < f->size) { /* the part of a read-around before its fault, at the next expert's first page */
        int32_t next = key_at(f, min_u64(asked + BLOCK, f->size) - 1);
        if (next != key_at(f, asked - 1) && is_expert(e, next))
            k = next;
    }
    const recent_t *r = read_before_locked(f, off, k, now);
    if (!r)
        return (intent_t){.key = k, .hops = hops_within_locked(f, off, k, now)};
    /* A boundary between two experts counts (a run-on counted its own where it began); one
     * between other tensors, which an engine reads whole, in order, at every step, does not. */
    uint32_t hops = r->hops + (!r->from && is_expert(e, r->key) && is_expert(e, k));
    if ((r->from && off - r->from >= RUN_ON_REACH) || hops >= STREAM_HOPS)
        return (intent_t){.key = k, .hops = hops};
    return (intent_t){.key = -1, .run_on = 1, .origin = r->key, .from = r->from ? r->from : off, .hops = hops};
}

/* A read [a, b) just now, remembered (whole pages: the kernel asks for no less). */
static void remember_locked(file_t *f, uint64_t a, uint64_t b, const intent_t *it, uint64_t now) {
    f->recent[f->nrecent++ % FILL_RECENT] = (recent_t){
        .lo = align_down_u64(a), .hi = align_up_u64(b), .t = now, .key = it->run_on ? it->origin : it->key,
        .from = it->run_on ? it->from : 0, .hops = it->hops};
}

/* Whether a read of key k lately ended where off begins: a reader streams through that tensor. */
static int streams_locked(const file_t *f, uint64_t off, int32_t k, uint64_t now) {
    for (size_t i = 0; i < FILL_RECENT; i++) {
        const recent_t *r = &f->recent[i];
        if (lately(r, now) && r->key == k && r->hi == off)
            return 1;
    }
    return 0;
}

/* What a fill reads, remembered: a routed expert's extents, whole (what it finds cached too), or the
 * stretch of a tensor it reads. Each extent carries the reader's stream on (its hops): the reader
 * passes through the ones the fill stores without a request to tell. */
static void remember_fill_locked(engine_t *e, file_t *f, const fill_t *fl, const intent_t *it, uint64_t now) {
    uint64_t a[FILL_RANGES], b[FILL_RANGES];
    size_t n = is_expert(e, it->key) ? key_extents(f, it->key, a, b, FILL_RANGES) : 0;
    for (size_t i = 0; i < n && i < FILL_RECENT / 2; i++)
        remember_locked(f, a[i], b[i], it, now);
    if (!n)
        remember_locked(f, fl->lo, fl->hi, it, now);
}

/* Whether a request of key k that no fill covers comes after the reader was done with what was read
 * of k: k was read lately (any read remembered under k: a fill's, a request's) and no fill of k is
 * listed any more. A loader reads an expert's tensors one after another; its lead's pages were
 * stored before it asked for them, so it went on past the lead without a request to show it. While
 * a fill of k is still read, a request beside it is another thread's fault (a lead of its own). */
static int went_past_locked(const engine_t *e, const file_t *f, int32_t k, uint64_t now) {
    int past = 0;
    for (size_t i = 0; i < FILL_RECENT && !past; i++)
        past = lately(&f->recent[i], now) && f->recent[i].key == k;
    for (const fill_t *x = e->fills.list; x && past; x = x->next)
        past = !(x->f == f && x->key == k);
    return past;
}

/* fill_for_locked's fill for the key it found, remembered: what it reads. A whole expert the arena
 * has no room for is read as a lead. */
static fill_t *start_for_locked(engine_t *e, file_t *f, const intent_t *it, uint64_t off, uint64_t asked,
                                int call, uint64_t now) {
    int streams = streamed(e, f, it->key, off, asked);
    if (streams == NOT_STREAMED && is_expert(e, it->key)) {
        if (call)
            streams = atomic_load(&f->direct_opens) ? NOT_STREAMED : ONWARD;
        else if (it->hops >= STREAM_HOPS)
            streams = IN_STREAM;
        else if (went_past_locked(e, f, it->key, now))
            streams = PAST_A_LEAD;
    }
    int spent = 0;
    fill_t *fl = start_locked(e, f, it->key, off, asked, streams, call, &spent);
    if (!fl && spent && !call && streams != NOT_STREAMED) { /* no room for the whole expert: a lead */
        streams = NOT_STREAMED;
        fl = start_locked(e, f, it->key, off, asked, streams, call, NULL);
    }
    if (!fl)
        return NULL;
    static const int counter[] = {[PAST_A_LEAD] = 16, [FROM_FIRST_PAGE] = 17, [IN_STREAM] = 20};
    if (counter[streams])
        atomic_fetch_add(&e->ctr.fill[counter[streams]], 1);
    if (streams == ONWARD) /* what it reads: none of the key's other extents */
        remember_locked(f, fl->lo, fl->hi, it, now);
    else
        remember_fill_locked(e, f, fl, it, now);
    return fl;
}

/* A new fill for the request [off, asked), or NULL: it runs on from another key's read, it is no
 * routed expert's and does not stream through its tensor, a fill reads some of its bytes already
 * (a read call's fill then reads the rest: its request's pieces span the two), fills are paused or
 * their budget is spent. A read call into an expert's extent mid-way, in a file with no O_DIRECT
 * open, reads the rest of it (ONWARD): an engine reads what it reads into its buffer to the end of
 * the extent, and no kernel readahead runs on into it. */
static fill_t *fill_for_locked(engine_t *e, file_t *f, uint64_t off, uint64_t asked, int call) {
    uint64_t now = mono_ns(), head = align_down_u64(off), tail = align_up_u64(asked);
    intent_t it = intent_locked(e, f, head, tail, call, now);
    if (it.run_on) {
        atomic_fetch_add(&e->ctr.fill[15], 1);
        remember_locked(f, head, tail, &it, now);
        return NULL;
    }
    int wanted = is_expert(e, it.key) || (it.key >= 0 && streams_locked(f, head, it.key, now));
    fill_t *fl = NULL;
    if (wanted && !atomic_load(&e->fills.paused) && (call || !overlaps_locked(e, f, off, asked)))
        fl = start_for_locked(e, f, &it, off, asked, call, now);
    if (!fl)
        remember_locked(f, head, tail, &it, now);
    return fl;
}

/* A request [off, asked) answered from x, a lead: once it begins RUN_ON_REACH away from the lead's
 * request (the kernel's readahead, running on from the expert before, reaches no farther), the
 * reader streams, and the rest of what a fill for it reads starts. A lead the arena had no room to
 * follow stays one: a later request tries again, once units came back. */
static void grow_locked(engine_t *e, fill_t *x, uint64_t off, uint64_t asked) {
    if (!x->lead || atomic_load(&e->fills.paused) || e->fills.nfree < x->retry ||
        (off < x->from + RUN_ON_REACH && asked + RUN_ON_REACH > x->from))
        return;
    int spent = 0;
    fill_t *rest = start_locked(e, x->f, x->key, off, asked, PAST_A_LEAD, x->held, &spent); /* listed: it answers now on */
    x->lead = spent;
    if (spent)
        x->retry = e->fills.nfree + 1;
    else if (rest) /* none when nothing was left to read (another fill, the page cache) */
        atomic_fetch_add(&e->ctr.fill[16], 1);
}

int fill_serve(engine_t *e, fuse_req_t req, file_t *f, uint64_t off, uint64_t asked, int call) {
    if (!e->fills.budget)
        return 0;
    fpiece_t *ps[MAX_IOV];
    pthread_mutex_lock(&e->fills.m);
    if (atomic_load(&e->reads_direct))
        expire_now_locked(e);
    size_t n = covering_locked(e, f, off, asked, ps);
    if (n) {
        for (size_t i = 0; i < n; i++)
            if (!i || ps[i]->fl != ps[i - 1]->fl)
                grow_locked(e, ps[i]->fl, off, asked);
        return answer_locked(e, f, req, off, asked, ps, n); /* unlocks */
    }
    n = fill_for_locked(e, f, off, asked, call) ? covering_locked(e, f, off, asked, ps) : 0;
    if (n)
        return answer_locked(e, f, req, off, asked, ps, n); /* unlocks */
    pthread_mutex_unlock(&e->fills.m);
    return 0;
}
