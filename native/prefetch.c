/* Expert-aware prefetch for page-cache readers (mmap faults, buffered reads): the first request
 * that touches a routed expert reads all of that expert (before and after the request: faults come
 * in any order), from all its drives at once, and what the kernel did not ask for goes into the
 * mount's page cache (FUSE notify_store), so the next faults of that expert never reach the drives
 * one readahead window at a time. It never reads past the expert's ends (where generic readahead
 * over-reads), at most prefetch_max bytes, and no more than STORE_INFLIGHT_MAX bytes wait to be
 * stored at once. O_DIRECT opens never prefetch.
 *
 * Stores run on a thread of their own, after the request's reply: notify_store waits for pages
 * that pending reads hold locked, so a FUSE thread storing before its reply could wait for a read
 * whose thread waits, storing, for this one's pages (seen: two threads deadlocked so, with
 * llama.cpp faulting one expert from several threads).
 */
#define _GNU_SOURCE
#include "engine.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define RECENT_NS 2000000000ull           /* a key prefetched this recently is not prefetched again */
#define STORE_INFLIGHT_MAX (256ull << 20) /* bytes read ahead and not yet stored */
#define PAGE 4096ull

typedef struct store_job {
    uint64_t ino, off;
    size_t len;
    char *data;
    struct store_job *next;
} store_job_t;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int prefetch_range(engine_t *e, file_t *f, uint64_t off, uint64_t asked, uint64_t *from, uint64_t *to) {
    if (!e->prefetch_max || !f->seg_prefetched || atomic_load(&e->prefetch_paused))
        return 0;
    /* The request's middle: a fault's read-around starts half a window before the faulting page,
     * often in the extent before (prefetching that one read experts nobody asked for). */
    uint32_t i = segment_at(f, off + (asked - off) / 2);
    int32_t k = f->seg_key[i];
    if (k < 0 || !e->key_expert[k])
        return 0;
    uint32_t lo = i, hi = i + 1; /* the key's extent around the request (faults come in any order) */
    while (lo > 0 && f->seg_key[lo - 1] == k)
        lo--;
    while (hi < f->nseg && f->seg_key[hi] == k)
        hi++;
    /* Per extent, not per key: a fused tensor holds one extent of the key, the next tensor another. */
    uint64_t t = now_ns(), last = atomic_load(&f->seg_prefetched[lo]);
    if (last && t - last < RECENT_NS) { /* asked again soon after a prefetch: it was not enough */
        atomic_fetch_add(&e->ctr.prefetch[2], asked - off);
        return 0;
    }
    uint64_t a = f->seg_start[lo], b = hi < f->nseg ? f->seg_start[hi] : f->size;
    if (b > off + e->prefetch_max)
        b = off + e->prefetch_max;
    if (b - a > e->prefetch_max)
        a = b - e->prefetch_max;
    a = (a + PAGE - 1) & ~(PAGE - 1); /* whole pages only: a partial one would not be kept */
    if (b != f->size)
        b &= ~(PAGE - 1);
    if (a > off)
        a = off;
    if (b < asked)
        b = asked;
    uint64_t extra = (b - a) - (asked - off);
    if (extra < PAGE)
        return 0;
    if (atomic_fetch_add(&e->store_inflight, extra) + extra > STORE_INFLIGHT_MAX) {
        atomic_fetch_sub(&e->store_inflight, extra);
        return 0;
    }
    if (!atomic_compare_exchange_strong(&f->seg_prefetched[lo], &last, t)) { /* another thread's */
        atomic_fetch_sub(&e->store_inflight, extra);
        return 0;
    }
    atomic_fetch_add(&e->ctr.prefetch[1], 1);
    *from = a;
    *to = b;
    return 1;
}

/* Queue [a, b) of what was read (data holds [start, ...)) for the store thread. */
static void store(engine_t *e, uint64_t ino, const char *data, uint64_t start, uint64_t a, uint64_t b) {
    uint64_t n = b - a;
    store_job_t *j = malloc(sizeof *j);
    char *copy = j ? malloc(n) : NULL;
    if (!copy) {
        free(j);
        atomic_fetch_sub(&e->store_inflight, n);
        return;
    }
    memcpy(copy, data + (a - start), n);
    *j = (store_job_t){ino, a, n, copy, NULL};
    pthread_mutex_lock(&e->store_m);
    if (e->store_tail)
        e->store_tail->next = j;
    else
        e->store_head = j;
    e->store_tail = j;
    pthread_cond_signal(&e->store_c);
    pthread_mutex_unlock(&e->store_m);
}

void prefetch_store(engine_t *e, uint64_t ino, file_t *f, const char *data, uint64_t start, uint64_t off,
                    uint64_t asked, uint64_t got_end, uint64_t from, uint64_t to) {
    /* Not the request's own pages: its reply just gave them to the kernel. */
    uint64_t left_end = off & ~(PAGE - 1), right = (asked + PAGE - 1) & ~(PAGE - 1);
    uint64_t right_end = got_end < to ? got_end : to;
    if (right_end != f->size)
        right_end &= ~(PAGE - 1);
    uint64_t stored = 0;
    if (left_end > from && got_end >= left_end) {
        store(e, ino, data, start, from, left_end);
        stored += left_end - from;
    }
    if (right_end > right) {
        store(e, ino, data, start, right, right_end);
        stored += right_end - right;
    }
    atomic_fetch_sub(&e->store_inflight, ((to - from) - (asked - off)) - stored); /* never stored */
}

static void *store_main(void *arg) {
    engine_t *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->store_m);
        while (!e->store_head && !e->store_stop)
            pthread_cond_wait(&e->store_c, &e->store_m);
        store_job_t *j = e->store_head;
        if (j) {
            e->store_head = j->next;
            if (!e->store_head)
                e->store_tail = NULL;
        }
        int stop = e->store_stop;
        pthread_mutex_unlock(&e->store_m);
        if (!j) {
            if (stop)
                return NULL;
            continue;
        }
        if (!stop) {
            struct fuse_bufvec bv = FUSE_BUFVEC_INIT(j->len);
            bv.buf[0].mem = j->data;
            if (fuse_lowlevel_notify_store(e->se, j->ino, (off_t)j->off, &bv, 0) == 0)
                atomic_fetch_add(&e->ctr.prefetch[0], j->len); /* in the page cache now */
        }
        atomic_fetch_sub(&e->store_inflight, j->len);
        free(j->data);
        free(j);
    }
}

int prefetch_start(engine_t *e) {
    if (!e->prefetch_max)
        return 0;
    pthread_mutex_init(&e->store_m, NULL);
    pthread_cond_init(&e->store_c, NULL);
    int err = pthread_create(&e->store_thread, NULL, store_main, e);
    e->store_started = !err;
    return err;
}

/* Stored pages are only a cache: what is still queued at unmount is dropped. */
void prefetch_stop(engine_t *e) {
    if (!e->store_started)
        return;
    pthread_mutex_lock(&e->store_m);
    e->store_stop = 1;
    pthread_cond_broadcast(&e->store_c);
    pthread_mutex_unlock(&e->store_m);
    struct timespec deadline; /* a store waiting for a page the unmount never releases: let it be */
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    if (pthread_timedjoin_np(e->store_thread, NULL, &deadline) != 0)
        pthread_detach(e->store_thread);
    e->store_started = 0;
}
