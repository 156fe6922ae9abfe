/* Whole-extent reads for page-cache readers (mmap faults, buffered reads). The kernel asks for such
 * a reader's bytes one or two 128 KiB requests at a time; each would land on one drive, and the
 * drives would rarely be busy at once. Instead the first request that touches a routed expert's
 * extent starts one read of all of that extent (at most STRETCH_MAX_UNITS MiB) from all its
 * drives at once (drives.c read_pieces), into units of a bounded buffer: a stretch. The kernel's
 * next requests in the stretch are answered from it, waiting for the piece they need while it is
 * being read, never reading it again. A stretch is freed once all of it was answered, when nobody
 * asked anything of it for AGE_NS, or when a new one needs its units. Nothing goes into the page
 * cache unasked. Routed experts only: an engine reads an expert's slice whole, an embedding table a
 * few rows at a time.
 *
 * Lock rules (engine.h, stretches): the lock guards the list, each stretch's refs, state, served and
 * used, and the free units. A piece's bytes are written by its reading while its state is S_READING
 * and read by requests only once they saw S_OK under the lock. A stretch's units go back to the
 * buffer when its last reference goes: the list's, its reader's, each request answering from it,
 * and the late jobs' of a timed-out mirror piece (they may still write into its units).
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>

#define STRETCH_MAX_UNITS 16     /* the most one stretch reads: 16 MiB */
#define STRETCH_MIN (256u << 10) /* less than this left of the extent: read as asked */
#define AGE_NS 1000000000ull     /* a stretch nobody asked anything of for this long is freed */

enum { S_READING, S_OK, S_FAILED };

typedef struct stretch {
    engine_t *e;
    file_t *f;
    uint64_t start, end; /* the file's bytes [start, end) */
    uint64_t used;       /* monotonic ns: the last request for it */
    uint64_t served;     /* bytes answered from it */
    int refs, listed;
    size_t nunits;
    uint32_t unit[STRETCH_MAX_UNITS];
    size_t n; /* pieces, each within one unit */
    piece_t *pc;
    uint8_t *state;
    struct stretch *next;
} stretch_t;

/* The reading of a stretch, by the thread whose request started it. */
typedef struct {
    stretch_t *s;
    fuse_req_t req;
    uint64_t off, asked;
    int replied;
} reader_t;

int stretch_init(engine_t *e, size_t units) {
    pthread_mutex_init(&e->stretches.m, NULL);
    pthread_cond_init(&e->stretches.published, NULL);
    if (!units)
        return 0;
    void *a = mmap(NULL, units * STRETCH_UNIT, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (a == MAP_FAILED)
        return errno;
    e->stretches.free_units = malloc(units * sizeof(uint32_t));
    if (!e->stretches.free_units) {
        munmap(a, units * STRETCH_UNIT);
        return ENOMEM;
    }
    for (size_t i = 0; i < units; i++) /* a stack: the units used last are used again (warm) */
        e->stretches.free_units[i] = (uint32_t)(units - 1 - i);
    e->stretches.arena = a;
    e->stretches.nunits = e->stretches.nfree = units;
    return 0;
}

static void unref_locked(engine_t *e, stretch_t *s) {
    if (--s->refs > 0)
        return;
    e->stretches.live--;
    for (size_t u = 0; u < s->nunits; u++)
        e->stretches.free_units[e->stretches.nfree++] = s->unit[u];
    atomic_fetch_sub(&e->ctr.stretch[5], (uint64_t)s->nunits * STRETCH_UNIT);
    free(s->pc);
    free(s->state);
    free(s);
}

static void unlist_locked(engine_t *e, stretch_t *s) {
    if (!s->listed)
        return;
    stretch_t **pp = &e->stretches.list;
    while (*pp != s)
        pp = &(*pp)->next;
    *pp = s->next;
    s->listed = 0;
    unref_locked(e, s);
}

/* After the loop. A stretch still referenced has late jobs on a hung mirror writing into it (their
 * threads were detached): its memory stays, to the exit. */
void stretch_free(engine_t *e) {
    if (!e->stretches.nunits)
        return;
    pthread_mutex_lock(&e->stretches.m);
    while (e->stretches.list)
        unlist_locked(e, e->stretches.list);
    size_t live = e->stretches.live;
    pthread_mutex_unlock(&e->stretches.m);
    if (live)
        return;
    if (e->stretches.arena)
        munmap(e->stretches.arena, e->stretches.nunits * STRETCH_UNIT);
    free(e->stretches.free_units);
    e->stretches.arena = NULL;
    e->stretches.free_units = NULL;
}

/* Stretches nobody uses go, and their units' memory back to the system: memory is short. */
void stretch_pause(engine_t *e, int paused) {
    atomic_store(&e->stretches.paused, paused);
    if (!paused || !e->stretches.nunits)
        return;
    pthread_mutex_lock(&e->stretches.m);
    for (stretch_t *s = e->stretches.list, *next; s; s = next) {
        next = s->next;
        if (s->refs == 1)
            unlist_locked(e, s);
    }
    for (size_t i = 0; i < e->stretches.nfree; i++)
        madvise(e->stretches.arena + (size_t)e->stretches.free_units[i] * STRETCH_UNIT, STRETCH_UNIT,
                MADV_DONTNEED);
    pthread_mutex_unlock(&e->stretches.m);
}

/* The file's byte at off, in the stretch's units. */
static char *at(const stretch_t *s, uint64_t off) {
    uint64_t rel = off - s->start;
    return s->e->stretches.arena + (size_t)s->unit[rel / STRETCH_UNIT] * STRETCH_UNIT + rel % STRETCH_UNIT;
}

/* S_OK when every piece of [off, asked) holds its bytes, S_FAILED when one never will. */
static int state_of(const stretch_t *s, uint64_t off, uint64_t asked) {
    int st = S_OK;
    for (size_t i = 0; i < s->n; i++) {
        if (s->pc[i].end <= off || s->pc[i].start >= asked)
            continue;
        if (s->state[i] == S_FAILED)
            return S_FAILED;
        if (s->state[i] == S_READING)
            st = S_READING;
    }
    return st;
}

static void reply_from(const stretch_t *s, fuse_req_t req, uint64_t off, uint64_t asked) {
    struct iovec iov[2]; /* a request is at most one unit long */
    int n = 0;
    for (uint64_t pos = off; pos < asked && n < 2; n++) {
        uint64_t unit_end = s->start + ((pos - s->start) / STRETCH_UNIT + 1) * STRETCH_UNIT;
        uint64_t to = asked < unit_end ? asked : unit_end;
        iov[n].iov_base = at(s, pos);
        iov[n].iov_len = to - pos;
        pos = to;
    }
    fuse_reply_iov(req, iov, n);
}

/* A request answered from s: its bytes count as served, and s goes once all of it was. */
static void served_locked(engine_t *e, stretch_t *s, uint64_t bytes, int waited) {
    s->served += bytes;
    atomic_fetch_add(&e->ctr.stretch[2], 1);
    atomic_fetch_add(&e->ctr.stretch[3], (uint64_t)waited);
    atomic_fetch_add(&e->ctr.stretch[4], bytes);
    if (s->served >= s->end - s->start)
        unlist_locked(e, s);
}

/* Called with the lock held; releases it. 1: answered; -1: a piece it needs failed. */
static int answer(engine_t *e, stretch_t *s, fuse_req_t req, uint64_t off, uint64_t asked, uint64_t now) {
    s->refs++;
    int st, waited = 0;
    while ((st = state_of(s, off, asked)) == S_READING) {
        waited = 1;
        pthread_cond_wait(&e->stretches.published, &e->stretches.m);
    }
    if (st == S_OK)
        s->used = now; /* one whose pieces failed ages as if unused */
    pthread_mutex_unlock(&e->stretches.m);
    if (st == S_OK)
        reply_from(s, req, off, asked);
    pthread_mutex_lock(&e->stretches.m);
    if (st == S_OK)
        served_locked(e, s, asked - off, waited);
    unref_locked(e, s);
    pthread_mutex_unlock(&e->stretches.m);
    return st == S_OK ? 1 : -1;
}

/* A piece landed (drives.c calls it on the reading thread): published, and the reader's own
 * request answered as soon as its bytes are all there. */
static void published(void *arg, size_t i) {
    reader_t *r = arg;
    stretch_t *s = r->s;
    engine_t *e = s->e;
    const piece_t *p = &s->pc[i];
    uint64_t want = (p->end < s->f->size ? p->end : s->f->size) - p->start;
    pthread_mutex_lock(&e->stretches.m);
    s->state[i] = (uint64_t)p->got == want ? S_OK : S_FAILED;
    pthread_cond_broadcast(&e->stretches.published);
    int mine = !r->replied && state_of(s, r->off, r->asked) == S_OK;
    pthread_mutex_unlock(&e->stretches.m);
    if (mine) {
        r->replied = 1;
        reply_from(s, r->req, r->off, r->asked);
    }
}

/* Mirror pieces timed out: the late jobs may still write into the units, which stay the stretch's
 * until they are done (late_done). Runs before any of them can finish. */
static int keep_for_late(void *arg, piece_t *pc, size_t n, void **release_arg) {
    (void)pc, (void)n;
    reader_t *r = arg;
    pthread_mutex_lock(&r->s->e->stretches.m);
    r->s->refs++;
    pthread_mutex_unlock(&r->s->e->stretches.m);
    *release_arg = r->s;
    return 0;
}

static void late_done(void *arg) {
    stretch_t *s = arg;
    engine_t *e = s->e;
    pthread_mutex_lock(&e->stretches.m);
    unref_locked(e, s);
    pthread_mutex_unlock(&e->stretches.m);
}

/* The segments [*lo, *hi) of key k around segment i: its whole extent. */
static void key_span(const file_t *f, uint32_t i, int32_t k, uint32_t *lo, uint32_t *hi) {
    *lo = i;
    *hi = i + 1;
    while (*lo > 0 && f->seg_key[*lo - 1] == k)
        (*lo)--;
    while (*hi < f->nseg && f->seg_key[*hi] == k)
        (*hi)++;
}

/* The stretch a request in a routed expert's extent would start: the whole extent (faults come in
 * any order: a memcpy may copy backwards, threads split a matrix's rows), or, of one longer than a
 * stretch, as much as fits from the request on; never over a neighbouring stretch (the one that
 * ends at prev_end or the one that starts at next), always the request's own bytes. */
static int extent_range(engine_t *e, file_t *f, uint64_t off, uint64_t asked, uint64_t prev_end, uint64_t next,
                        uint64_t *start, uint64_t *end) {
    uint32_t i = segment_at(f, off + (asked - off) / 2); /* a fault's read-around starts before it */
    int32_t k = f->seg_key[i];
    if (k < 0 || !e->key_expert[k] || asked > next)
        return 0;
    uint32_t lo, hi;
    key_span(f, i, k, &lo, &hi);
    const uint64_t most = (uint64_t)STRETCH_MAX_UNITS * STRETCH_UNIT - BLOCK;
    uint64_t head = align_down_u64(off);
    uint64_t a = align_down_u64(f->seg_start[lo]), b = hi < f->nseg ? f->seg_start[hi] : f->size;
    if (b - a > most)
        a = head;
    a = min_u64(max_u64(a, prev_end), head);
    b = min_u64(min_u64(b, next), a + most);
    if (b < asked || b - a < STRETCH_MIN)
        return 0;
    *start = a;
    *end = b;
    return 1;
}

/* Units for a new stretch: free ones, else those of the stretches used longest ago that nobody uses. */
static int take_units_locked(engine_t *e, stretch_t *s, size_t units) {
    size_t could = e->stretches.nfree;
    for (stretch_t *x = e->stretches.list; x; x = x->next)
        could += x->refs == 1 ? x->nunits : 0;
    if (could < units)
        return 0; /* evict nothing for a stretch that would not start anyway */
    while (e->stretches.nfree < units) {
        stretch_t *oldest = NULL;
        for (stretch_t *x = e->stretches.list; x; x = x->next)
            if (x->refs == 1 && (!oldest || x->used < oldest->used))
                oldest = x;
        if (!oldest)
            return 0;
        unlist_locked(e, oldest);
    }
    for (size_t u = 0; u < units; u++)
        s->unit[u] = e->stretches.free_units[--e->stretches.nfree];
    s->nunits = units;
    atomic_fetch_add(&e->ctr.stretch[5], (uint64_t)units * STRETCH_UNIT);
    return 1;
}

/* The runs of [start, stop), cut at unit boundaries (each piece is read into one unit), the piece
 * holding `off` first: the request that starts the stretch is answered as soon as can be. */
static int cut_pieces(engine_t *e, stretch_t *s, uint64_t end, uint64_t stop, uint64_t off) {
    size_t cap = runs_bound(s->f, s->start, stop) + s->nunits; /* cutting adds one per unit at most */
    piece_t *runs = malloc(cap * sizeof *runs);
    s->pc = malloc(cap * sizeof *s->pc);
    s->state = calloc(cap, 1); /* S_READING */
    if (!runs || !s->pc || !s->state) {
        free(runs);
        return 0;
    }
    size_t nr = plan_runs(e, s->f, s->start, end, stop, s->start, 0, runs);
    for (size_t r = 0; r < nr; r++) {
        for (uint64_t a = runs[r].start; a < runs[r].end;) {
            uint64_t unit_end = s->start + ((a - s->start) / STRETCH_UNIT + 1) * STRETCH_UNIT;
            uint64_t b = runs[r].end < unit_end ? runs[r].end : unit_end;
            s->pc[s->n++] = (piece_t){.start = a, .end = b, .drive = runs[r].drive, .dst = at(s, a)};
            a = b;
        }
    }
    size_t first = 0;
    while (first + 1 < s->n && s->pc[first].end <= off)
        first++;
    for (size_t i = 0; i < s->n; i++) /* rotated through runs: it is free again */
        runs[i] = s->pc[(first + i) % s->n];
    memcpy(s->pc, runs, s->n * sizeof *runs);
    free(runs);
    return 1;
}

/* A new stretch for [off, asked), listed (so no other request starts one over it), or NULL. */
static stretch_t *start_locked(engine_t *e, file_t *f, uint64_t off, uint64_t asked, uint64_t prev_end,
                               uint64_t next, uint64_t now) {
    uint64_t start, end;
    if (!extent_range(e, f, off, asked, prev_end, next, &start, &end))
        return NULL;
    uint64_t stop = (end + BLOCK - 1) & ~(uint64_t)(BLOCK - 1);
    stretch_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    *s = (stretch_t){.e = e, .f = f, .start = start, .end = stop < f->size ? stop : f->size, .used = now};
    if (!take_units_locked(e, s, (size_t)((stop - start + STRETCH_UNIT - 1) / STRETCH_UNIT))) {
        atomic_fetch_add(&e->ctr.stretch[6], 1);
        free(s);
        return NULL;
    }
    s->refs = 1; /* its units go back through unref_locked from here on */
    e->stretches.live++;
    if (!cut_pieces(e, s, end, stop, off)) {
        unref_locked(e, s);
        return NULL;
    }
    s->refs = 2; /* the list's and the reader's */
    s->listed = 1;
    s->next = e->stretches.list;
    e->stretches.list = s;
    return s;
}

/* Reads the stretch and answers the request that started it: 1, or -1 when a piece it needs failed.
 * The file is held open meanwhile: the reading goes on after that answer, and a release must not
 * close (and a new open reuse) the descriptors it reads. */
static int read_stretch(engine_t *e, stretch_t *s, fuse_req_t req, uint64_t off, uint64_t asked) {
    file_t *f = s->f; /* s may be gone once its reference is dropped */
    reader_t r = {s, req, off, asked, 0};
    reading_t how = {.ready = published, .abandon = keep_for_late, .release = late_done, .arg = &r,
                     .count_from = s->start, .count_to = s->end};
    notes_t nt;
    nt.n = 0;
    atomic_fetch_add(&e->ctr.stretch[0], 1);
    atomic_fetch_add(&e->ctr.stretch[1], s->end - s->start);
    int held = file_open(e, f) == 0; /* the request's own open keeps it open: no open happens */
    read_pieces(e, f, s->pc, s->n, &how, &nt); /* failures: the pieces stay unpublished */
    if (held)
        file_release(e, f);
    uint32_t timed_out = 0; /* drives that timed out: counted once each, as a request's run is */
    for (size_t i = 0; i < s->n; i++)
        if (s->pc[i].status == RES_TIMEOUT && !(timed_out & (1u << s->pc[i].drive))) {
            timed_out |= 1u << s->pc[i].drive; /* its requests read those pieces from the primary */
            atomic_fetch_add(&e->ctr.drive_errors[s->pc[i].drive], 1);
            atomic_fetch_add(e->ctr.fallbacks, 1);
        }
    pthread_mutex_lock(&e->stretches.m);
    for (size_t i = 0; i < s->n; i++)
        if (s->state[i] == S_READING)
            s->state[i] = S_FAILED;
    pthread_cond_broadcast(&e->stretches.published);
    if (r.replied)
        served_locked(e, s, asked - off, 0);
    unref_locked(e, s);
    pthread_mutex_unlock(&e->stretches.m);
    send_notes(e, f, &nt);
    return r.replied ? 1 : -1;
}

/* The stretch that holds [off, asked), or NULL with the neighbours a new one must stay between. */
static stretch_t *find_locked(engine_t *e, file_t *f, uint64_t off, uint64_t asked, int *overlaps,
                              uint64_t *prev_end, uint64_t *next) {
    *overlaps = 0;
    *prev_end = 0;
    *next = UINT64_MAX;
    for (stretch_t *s = e->stretches.list; s; s = s->next) {
        if (s->f != f)
            continue;
        if (s->start <= off && off < s->end) {
            if (asked <= s->end)
                return s;
            *overlaps = 1; /* the request runs past it: served as if there were no stretch */
        } else if (s->start > off && s->start < *next) {
            *next = s->start;
        } else if (s->end <= off && s->end > *prev_end) {
            *prev_end = s->end;
        }
    }
    return NULL;
}

int stretch_serve(engine_t *e, fuse_req_t req, file_t *f, uint64_t off, uint64_t asked) {
    if (!e->stretches.nunits || asked - off > STRETCH_UNIT)
        return 0;
    uint64_t now = mono_ns();
    pthread_mutex_lock(&e->stretches.m);
    for (stretch_t *s = e->stretches.list, *next; s; s = next) {
        next = s->next;
        if (s->refs == 1 && now > s->used + AGE_NS)
            unlist_locked(e, s);
    }
    int overlaps;
    uint64_t prev_end, next;
    stretch_t *s = find_locked(e, f, off, asked, &overlaps, &prev_end, &next);
    if (s)
        return answer(e, s, req, off, asked, now); /* unlocks */
    if (!overlaps && !atomic_load(&e->stretches.paused))
        s = start_locked(e, f, off, asked, prev_end, next, now);
    pthread_mutex_unlock(&e->stretches.m);
    return s ? read_stretch(e, s, req, off, asked) : 0;
}
