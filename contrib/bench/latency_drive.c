/* A drive with latency, for the benchmark rigs (contrib/bench/latency_drive.py runs it). Not part
 * of colifs.
 *
 * A throttled loop device is a bandwidth cap: one request in flight gets the whole drive. A real
 * NVMe makes every read wait tens of microseconds before its bytes flow, so one request in flight
 * gets a fraction of it. This server presents one file, "disk", backed by an image in RAM; a loop
 * device with direct I/O over that file is the drive (ext4 goes on it). Each read of the disk is
 * answered at
 *
 *     done = max(arrival + latency, previous done) + size / rate
 *
 * (reads overlap in their latency; their bytes leave one after another at the rate), so the
 * bandwidth one reader gets follows its queue depth: size / (latency + size / rate) at depth 1, the
 * rate at depth >= 1 + latency * rate / size. Writes (mkfs, filling the drive) are copied at once.
 *
 *   latency_drive IMAGE MOUNTPOINT LATENCY_US MB_PER_S     (MB_PER_S 0: no rate limit)
 *
 * Files: "disk" (the image, read and written), "params" (read: "latency_us=L mb_per_s=R"; a write
 * of either or both sets them from then on: a drive that slows while serving), "stats" (reads,
 * bytes, busy_ns with a read in flight, depth_ns the integral of reads in flight over time). Runs in
 * the foreground until unmounted (or SIGTERM). Root only. */
#define _GNU_SOURCE
#define FUSE_USE_VERSION 312
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum { INO_ROOT = 1, INO_DISK, INO_PARAMS, INO_STATS, NFILES = 3 };
static const char *const names[NFILES] = {"disk", "params", "stats"};
#define REPLIERS 4 /* threads that sleep until a read's time, then answer it */

typedef struct item {
    fuse_req_t req;
    uint64_t off, len, due;
    struct item *next;
} item_t;

/* Lock rules: g.m guards the queue, the parameters, last_done and the counters. The image's bytes
 * are read and written without it (a read racing a write of the same block is the loop device's
 * business, as on a real drive). */
static struct {
    char *map;
    uint64_t size;
    pthread_mutex_t m;
    pthread_cond_t c;
    item_t *head, *tail;
    int stop;
    uint64_t latency_ns;
    double ns_per_byte;
    uint64_t last_done;
    uint64_t reads, bytes, inflight, busy_ns, depth_ns, since;
} g = {.m = PTHREAD_MUTEX_INITIALIZER, .c = PTHREAD_COND_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* The reads in flight change by delta: their integral over time and the busy time first. */
static void inflight_locked(int delta) {
    uint64_t t = now_ns();
    if (g.inflight)
        g.busy_ns += t - g.since;
    g.depth_ns += g.inflight * (t - g.since);
    g.since = t;
    g.inflight = (uint64_t)((int64_t)g.inflight + delta);
}

static void set_params(uint64_t latency_us, double mb_per_s) {
    g.latency_ns = latency_us * 1000;
    g.ns_per_byte = mb_per_s > 0 ? 1e3 / mb_per_s : 0;
}

static int render(fuse_ino_t ino, char *buf, size_t n) {
    pthread_mutex_lock(&g.m);
    inflight_locked(0);
    int len = ino == INO_PARAMS
                  ? snprintf(buf, n, "latency_us=%llu mb_per_s=%g\n", (unsigned long long)(g.latency_ns / 1000),
                             g.ns_per_byte > 0 ? 1e3 / g.ns_per_byte : 0.0)
                  : snprintf(buf, n, "reads %llu bytes %llu busy_ns %llu depth_ns %llu\n",
                             (unsigned long long)g.reads, (unsigned long long)g.bytes,
                             (unsigned long long)g.busy_ns, (unsigned long long)g.depth_ns);
    pthread_mutex_unlock(&g.m);
    return len;
}

static void *replier(void *arg) {
    (void)arg;
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake at the time asked, not up to 50 us after it */
    for (;;) {
        pthread_mutex_lock(&g.m);
        while (!g.head && !g.stop)
            pthread_cond_wait(&g.c, &g.m);
        item_t *it = g.head;
        if (!it) {
            pthread_mutex_unlock(&g.m);
            return NULL;
        }
        g.head = it->next;
        if (!g.head)
            g.tail = NULL;
        pthread_mutex_unlock(&g.m);
        struct timespec due = {(time_t)(it->due / 1000000000ull), (long)(it->due % 1000000000ull)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &due, NULL) == EINTR)
            ;
        fuse_reply_buf(it->req, g.map + it->off, it->len);
        pthread_mutex_lock(&g.m);
        inflight_locked(-1);
        pthread_mutex_unlock(&g.m);
        free(it);
    }
}

static void attr(fuse_ino_t ino, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_nlink = 1;
    if (ino == INO_ROOT) {
        st->st_mode = S_IFDIR | 0755;
        st->st_nlink = 2;
    } else {
        st->st_mode = S_IFREG | 0644;
        st->st_size = ino == INO_DISK ? (off_t)g.size : 4096;
    }
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    for (int i = 0; parent == INO_ROOT && i < NFILES; i++) {
        if (strcmp(name, names[i]) == 0) {
            struct fuse_entry_param e = {.ino = (fuse_ino_t)(INO_DISK + i), .attr_timeout = 3600,
                                         .entry_timeout = 3600};
            attr(e.ino, &e.attr);
            fuse_reply_entry(req, &e);
            return;
        }
    }
    fuse_reply_err(req, ENOENT);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)fi;
    struct stat st;
    attr(ino, &st);
    fuse_reply_attr(req, &st, 3600);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)ino, (void)fi;
    char buf[1024];
    size_t used = 0;
    for (int i = (int)off; i < NFILES; i++) {
        struct stat st;
        attr((fuse_ino_t)(INO_DISK + i), &st);
        size_t need = fuse_add_direntry(req, buf + used, sizeof buf - used, names[i], &st, i + 1);
        if (need > sizeof buf - used || used + need > size)
            break;
        used += need;
    }
    fuse_reply_buf(req, buf, used);
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    fi->direct_io = 1; /* no page cache of this file system's own: the loop device and ext4 above
                          it are the drive and its cache */
    fuse_reply_open(req, fi);
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    if (ino != INO_DISK) {
        char buf[256];
        int len = render(ino, buf, sizeof buf);
        fuse_reply_buf(req, buf + (off < len ? off : len), off < len ? (size_t)(len - off) : 0);
        return;
    }
    uint64_t o = (uint64_t)off < g.size ? (uint64_t)off : g.size;
    uint64_t len = size < g.size - o ? size : g.size - o;
    item_t *it = malloc(sizeof *it);
    if (!it) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    *it = (item_t){.req = req, .off = o, .len = len};
    pthread_mutex_lock(&g.m);
    uint64_t t = now_ns(), start = t + g.latency_ns;
    if (start < g.last_done)
        start = g.last_done;
    it->due = start + (uint64_t)((double)len * g.ns_per_byte);
    g.last_done = it->due;
    inflight_locked(1);
    g.reads++;
    g.bytes += len;
    if (g.tail)
        g.tail->next = it;
    else
        g.head = it;
    g.tail = it;
    pthread_cond_signal(&g.c);
    pthread_mutex_unlock(&g.m);
}

/* "latency_us=L", "mb_per_s=R", or both, separated by blanks. */
static int parse_params(const char *buf, size_t size) {
    char text[256];
    if (size >= sizeof text)
        return EINVAL;
    memcpy(text, buf, size);
    text[size] = 0;
    pthread_mutex_lock(&g.m);
    uint64_t lat = g.latency_ns / 1000;
    double rate = g.ns_per_byte > 0 ? 1e3 / g.ns_per_byte : 0;
    int ok = 1;
    for (char *save, *tok = strtok_r(text, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save))
        ok &= sscanf(tok, "latency_us=%lu", &lat) == 1 || sscanf(tok, "mb_per_s=%lf", &rate) == 1;
    if (ok)
        set_params(lat, rate);
    pthread_mutex_unlock(&g.m);
    return ok ? 0 : EINVAL;
}

static void op_write(fuse_req_t req, fuse_ino_t ino, const char *buf, size_t size, off_t off,
                     struct fuse_file_info *fi) {
    (void)fi;
    int err = 0;
    if (ino == INO_PARAMS)
        err = parse_params(buf, size);
    else if (ino != INO_DISK || (uint64_t)off + size > g.size)
        err = ino == INO_DISK ? ENOSPC : EACCES;
    else
        memcpy(g.map + off, buf, size);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_write(req, size);
}

static void op_ok(fuse_req_t req) { fuse_reply_err(req, 0); }
static void op_flush(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino, (void)fi;
    op_ok(req);
}
static void op_fsync(fuse_req_t req, fuse_ino_t ino, int datasync, struct fuse_file_info *fi) {
    (void)ino, (void)datasync, (void)fi;
    op_ok(req);
}
static void op_setattr(fuse_req_t req, fuse_ino_t ino, struct stat *a, int set, struct fuse_file_info *fi) {
    (void)a, (void)set, (void)fi;
    struct stat st;
    attr(ino, &st); /* a truncate to the same size (params, stats) changes nothing */
    fuse_reply_attr(req, &st, 3600);
}

/* Deep queues, as an NVMe has: the kernel keeps at most max_background async requests in flight. */
static void op_init(void *data, struct fuse_conn_info *conn) {
    (void)data;
    conn->max_background = 256;
    conn->congestion_threshold = 256;
}

static const struct fuse_lowlevel_ops ops = {
    .init = op_init,
    .lookup = op_lookup,
    .getattr = op_getattr,
    .setattr = op_setattr,
    .readdir = op_readdir,
    .open = op_open,
    .read = op_read,
    .write = op_write,
    .flush = op_flush,
    .fsync = op_fsync,
};

static int map_image(const char *path) {
    int fd = open(path, O_RDWR);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        return -1;
    }
    g.size = (uint64_t)st.st_size;
    g.map = mmap(NULL, g.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (g.map == MAP_FAILED) {
        perror("mmap");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s IMAGE MOUNTPOINT LATENCY_US MB_PER_S\n", argv[0]);
        return 2;
    }
    if (map_image(argv[1]) != 0)
        return 1;
    set_params(strtoull(argv[3], NULL, 10), strtod(argv[4], NULL));
    g.since = now_ns();
    char *fargv[] = {argv[0], "-o", "fsname=latency_drive,subtype=latency_drive", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, fargv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (!se || fuse_set_signal_handlers(se) != 0 || fuse_session_mount(se, argv[2]) != 0)
        return 1;
    pthread_t t[REPLIERS];
    for (int i = 0; i < REPLIERS; i++)
        pthread_create(&t[i], NULL, replier, NULL);
    struct fuse_loop_config *cfg = fuse_loop_cfg_create();
    fuse_loop_cfg_set_max_threads(cfg, 4);
    int rc = fuse_session_loop_mt(se, cfg);
    fuse_loop_cfg_destroy(cfg);
    pthread_mutex_lock(&g.m);
    g.stop = 1;
    pthread_cond_broadcast(&g.c);
    pthread_mutex_unlock(&g.m);
    for (int i = 0; i < REPLIERS; i++)
        pthread_join(t[i], NULL);
    fuse_session_unmount(se);
    fuse_remove_signal_handlers(se);
    fuse_session_destroy(se);
    return rc ? 1 : 0;
}
