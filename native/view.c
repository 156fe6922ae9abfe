/* The daemon's own view of the files it serves: what the mount's page cache holds of them, so that
 * a fill (fill.c) reads only the pages a reader still lacks. A file that a page-cache reader holds
 * open is opened once more by the view thread, through a detached clone of the mount (open_tree
 * OPEN_TREE_CLONE), and mapped; mincore(2) on that mapping tells which pages are cached, without
 * touching any. The clone, not the mount, is what the view's descriptors pin: `umount` of the
 * mount never finds it busy because of them. A view goes once the file's last reader released it
 * (the kernel's RELEASE, a moment after its close), and the clone with the last view; the mount's
 * connection then ends as it would without them. Needs CAP_SYS_ADMIN (open_tree): without it there
 * are no views, and fills read leads and whole experts, cached or not.
 *
 * Lock rules (engine.h, views): views.m guards the queue and each file's view_queued; a file's
 * user_opens change under its lock; view_fd, the clone and nviews are the view thread's alone; a
 * file's view_map is set and cleared under fills.m (by the view thread), and read only under it
 * (fill.c), so a mapping is never used after it is unmapped.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

/* The path of every served file within the mount, from the tables (a depth-first walk). */
static int name_files(engine_t *e, uint64_t ino, const char *prefix) {
    node_t *n = engine_node(e, ino);
    if (!n || n->kind != NODE_DIR)
        return 0;
    for (uint32_t i = 0; i < n->nchildren; i++) {
        const child_t *c = &e->children[n->first_child + i];
        node_t *cn = engine_node(e, c->ino);
        char *path = NULL;
        if (!cn || asprintf(&path, "%s%s%s", prefix, *prefix ? "/" : "", c->name) < 0)
            return cn ? ENOMEM : 0;
        int err = 0;
        if (cn->kind == NODE_REG && cn->file >= 0 && !e->files[cn->file].mpath)
            e->files[cn->file].mpath = path, path = NULL;
        else if (cn->kind == NODE_DIR)
            err = name_files(e, c->ino, path);
        free(path);
        if (err)
            return err;
    }
    return 0;
}

int views_init(engine_t *e) {
    pthread_mutex_init(&e->views.m, NULL);
    pthread_cond_init(&e->views.c, NULL);
    e->views.clone = -1;
    for (size_t i = 0; i < e->nfiles; i++)
        e->files[i].view_fd = -1;
    if (!e->fills.budget || e->passthrough == PT_ALWAYS) /* nothing to look at; and a view open would
                                               be served, which keeps page-cache opens from passing through */
        return 0;
    e->views.queue = calloc(e->nfiles ? e->nfiles : 1, sizeof(file_t *));
    if (!e->views.queue)
        return ENOMEM;
    e->views.on = 1;
    return name_files(e, FUSE_ROOT_ID, "");
}

static void view_open(engine_t *e, file_t *f) {
    if (e->views.clone < 0) {
        e->views.clone = open_tree(AT_FDCWD, e->mountpoint, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
        if (e->views.clone < 0) {
            atomic_store(&e->ctr.fill[10], (uint64_t)errno);
            return;
        }
    }
    int fd = f->mpath && f->size ? openat(e->views.clone, f->mpath, O_RDONLY | O_CLOEXEC) : -1;
    void *map = fd >= 0 ? mmap(NULL, f->size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (map == MAP_FAILED) {
        if (fd >= 0) {
            atomic_store(&e->ctr.fill[10], (uint64_t)errno);
            close(fd);
        }
        if (!e->views.nviews) {
            close(e->views.clone);
            e->views.clone = -1;
        }
        return;
    }
    f->view_fd = fd;
    atomic_store(&e->ctr.fill[9], (uint64_t)++e->views.nviews);
    pthread_mutex_lock(&e->fills.m);
    f->view_map = map;
    pthread_mutex_unlock(&e->fills.m);
}

static void view_close(engine_t *e, file_t *f) {
    pthread_mutex_lock(&e->fills.m);
    char *map = f->view_map;
    f->view_map = NULL;
    pthread_mutex_unlock(&e->fills.m);
    munmap(map, f->size);
    close(f->view_fd); /* its RELEASE comes back to this daemon: a view's, not counted (fs.c) */
    f->view_fd = -1;
    atomic_store(&e->ctr.fill[9], (uint64_t)--e->views.nviews);
    if (e->views.nviews == 0) {
        close(e->views.clone);
        e->views.clone = -1;
    }
}

static void *view_main(void *arg) {
    engine_t *e = arg;
    atomic_store(&e->views.tid, gettid());
    for (;;) {
        pthread_mutex_lock(&e->views.m);
        while (!e->views.nqueued && !e->views.stop)
            pthread_cond_wait(&e->views.c, &e->views.m);
        if (e->views.stop) {
            pthread_mutex_unlock(&e->views.m);
            return NULL;
        }
        file_t *f = e->views.queue[--e->views.nqueued];
        f->view_queued = 0;
        pthread_mutex_unlock(&e->views.m);
        pthread_mutex_lock(&f->lock);
        int want = f->user_opens > 0;
        pthread_mutex_unlock(&f->lock);
        if (want && f->view_fd < 0)
            view_open(e, f);
        else if (!want && f->view_fd >= 0)
            view_close(e, f);
    }
}

int views_start(engine_t *e) {
    if (!e->views.on)
        return 0;
    int err = pthread_create(&e->views.thread, NULL, view_main, e);
    e->views.started = !err;
    return err;
}

/* The view thread stops; the views it left close (after the session: their closes then need no
 * answer from this daemon). A view thread stuck in an open that will never be answered (the loop
 * is over) is left detached. */
void views_stop(engine_t *e) {
    if (!e->views.started)
        return;
    pthread_mutex_lock(&e->views.m);
    e->views.stop = 1;
    pthread_cond_signal(&e->views.c);
    pthread_mutex_unlock(&e->views.m);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 5;
    e->views.started = 0;
    if (pthread_timedjoin_np(e->views.thread, NULL, &deadline) != 0) {
        pthread_detach(e->views.thread);
        e->threads_left = 1;
        return;
    }
    for (size_t i = 0; i < e->nfiles; i++)
        if (e->files[i].view_fd >= 0)
            view_close(e, &e->files[i]);
}

/* f's view is to be looked at again (f->lock held): opened or closed by the view thread. */
static void reconsider_locked(engine_t *e, file_t *f) {
    pthread_mutex_lock(&e->views.m);
    if (!f->view_queued) {
        f->view_queued = 1;
        e->views.queue[e->views.nqueued++] = f;
        pthread_cond_signal(&e->views.c);
    }
    pthread_mutex_unlock(&e->views.m);
}

int view_is_mine(engine_t *e, fuse_req_t req) {
    return e->views.on && fuse_req_ctx(req)->pid == atomic_load(&e->views.tid);
}

void view_reader(engine_t *e, file_t *f, int delta) {
    if (!e->views.on)
        return;
    pthread_mutex_lock(&f->lock);
    f->user_opens += delta;
    if (f->user_opens == (delta > 0 ? 1 : 0))
        reconsider_locked(e, f);
    pthread_mutex_unlock(&f->lock);
}

size_t view_cached(const file_t *f, uint64_t a, uint64_t b, unsigned char *vec) {
    if (!f->view_map || b <= a)
        return 0;
    b = min_u64(b, align_up_u64(f->size));
    size_t pages = (size_t)((b - a) / BLOCK);
    if (mincore(f->view_map + a, (size_t)(b - a), vec) != 0)
        return 0;
    return pages;
}
