/* The floor under every FUSE read path on this machine: a server that does nothing per request but
 * read the backing file and reply. Not part of colifs; contrib/bench/fuse_floor.py measures it.
 *
 *   fuse_floor classic N BACKING MOUNTPOINT   N threads read requests from /dev/fuse and writev the
 *                                             replies (what libfuse's loop does)
 *   fuse_floor uring E BACKING MOUNTPOINT     FUSE over io_uring (Linux 6.14+, fuse module parameter
 *                                             enable_uring=Y): a thread per CPU queue, E entries
 *                                             each; a READ is read straight into the entry's payload
 *                                             buffer and committed with the next fetch
 *   fuse_floor touch FILE THREADS SECONDS     a reader: THREADS threads fault in 1 MiB stretches of
 *                                             an mmap of FILE at random places (a decode's pattern)
 *
 * It asks for what libfuse asks for by default where reads are concerned, FUSE_ASYNC_DIO above all:
 * without it an O_DIRECT reader's requests go one at a time and its pages are released on its own
 * thread, not the server's, which made this floor look cheaper than colifs for O_DIRECT readers
 * (docs/benchmarks.md run 70b). The served directory holds one file, "model", the backing file
 * (opened O_DIRECT). Root only: it mounts with mount(2); unmount with umount -l. The
 * FUSE-over-io_uring ABI (uapi fuse.h 7.42) is declared here: Debian 12's kernel headers predate it. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define OVER_IO_URING_FLAGS2 (1u << (41 - 32)) /* FUSE_OVER_IO_URING, in init_out.flags2 */
#define PAYLOAD (1u << 20)                     /* max_pages 256: the largest request */
#define NO_REPLY (-1000)
enum { CMD_REGISTER = 1, CMD_COMMIT_AND_FETCH = 2 };

struct ent_in_out {
    uint64_t flags, commit_id;
    uint32_t payload_sz, padding;
    uint64_t reserved;
};
struct req_header { /* iov[0] of an entry */
    char in_out[128]; /* fuse_in_header as fetched, fuse_out_header as committed */
    char op_in[128];  /* the op's first argument */
    struct ent_in_out ent;
};
struct cmd_req { /* the SQE128's command area */
    uint64_t flags, commit_id;
    uint16_t qid;
    uint8_t padding[6];
};
struct entry {
    struct req_header *hdr;
    char *payload;
    struct iovec iov[2];
};

static int devfd, backfd, uring_mode, entries_per_queue;
static struct stat backst;

static char *page_buffer(size_t n) {
    void *p;
    if (posix_memalign(&p, 4096, n)) abort();
    return p;
}

static void attr_of(uint64_t ino, struct fuse_attr *a) {
    memset(a, 0, sizeof *a);
    a->ino = ino;
    a->blksize = 4096;
    a->nlink = ino == FUSE_ROOT_ID ? 2 : 1;
    a->mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0555 : S_IFREG | 0444;
    a->size = ino == FUSE_ROOT_ID ? 0 : (uint64_t)backst.st_size;
    a->blocks = (a->size + 511) / 512;
}

static long init_reply(const struct fuse_init_in *in, char *out) {
    struct fuse_init_out *o = (void *)out;
    memset(o, 0, sizeof *o);
    o->major = FUSE_KERNEL_VERSION;
    o->minor = 42;
    o->max_readahead = in->max_readahead;
    o->flags = FUSE_ASYNC_READ | FUSE_ASYNC_DIO | FUSE_MAX_PAGES | FUSE_INIT_EXT;
    o->flags2 = uring_mode ? OVER_IO_URING_FLAGS2 : 0;
    o->max_background = 64;
    o->congestion_threshold = 48;
    o->max_write = PAYLOAD;
    o->max_pages = PAYLOAD / 4096;
    o->time_gran = 1;
    return sizeof *o;
}

/* One request: `arg` the op's first argument, `rest` what follows it (a name); the reply's
 * payload goes to `out` (page-aligned, PAYLOAD bytes). Returns its size, -errno, or NO_REPLY. */
static long handle(const struct fuse_in_header *ih, const void *arg, const char *rest, char *out) {
    switch (ih->opcode) {
    case FUSE_INIT:
        return init_reply(arg, out);
    case FUSE_LOOKUP: {
        if (ih->nodeid != FUSE_ROOT_ID || strcmp(rest, "model")) return -ENOENT;
        struct fuse_entry_out *o = (void *)out;
        memset(o, 0, sizeof *o);
        o->nodeid = 2;
        o->entry_valid = o->attr_valid = 3600;
        attr_of(2, &o->attr);
        return sizeof *o;
    }
    case FUSE_GETATTR: {
        struct fuse_attr_out *o = (void *)out;
        memset(o, 0, sizeof *o);
        o->attr_valid = 3600;
        attr_of(ih->nodeid, &o->attr);
        return sizeof *o;
    }
    case FUSE_OPEN: {
        struct fuse_open_out *o = (void *)out;
        memset(o, 0, sizeof *o);
        o->open_flags = FOPEN_KEEP_CACHE;
        return sizeof *o;
    }
    case FUSE_READ: {
        const struct fuse_read_in *in = arg;
        ssize_t n = pread(backfd, out, in->size, (off_t)in->offset);
        return n < 0 ? -errno : n;
    }
    case FUSE_RELEASE:
    case FUSE_FLUSH:
        return 0;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
    case FUSE_INTERRUPT:
        return NO_REPLY;
    default:
        return -ENOSYS;
    }
}

/* /dev/fuse: INIT, and every request until the ring is ready (forgets after it too). */
static void *classic(void *unused) {
    (void)unused;
    char *in = page_buffer(PAYLOAD + 8192), *out = page_buffer(PAYLOAD);
    for (;;) {
        ssize_t n = read(devfd, in, PAYLOAD + 8192);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == ENOENT)) continue;
        if (n < 0) return NULL; /* ENODEV: unmounted */
        const struct fuse_in_header *ih = (void *)in;
        long r = handle(ih, in + sizeof *ih, in + sizeof *ih, out);
        if (r == NO_REPLY) continue;
        struct fuse_out_header oh = {.unique = ih->unique, .error = r < 0 ? (int32_t)r : 0};
        struct iovec iov[2] = {{&oh, sizeof oh}, {out, r > 0 ? (size_t)r : 0}};
        oh.len = (uint32_t)(sizeof oh + iov[1].iov_len);
        if (writev(devfd, iov, 2) < 0 && errno != ENOENT) perror("writev");
    }
}

static void command(struct io_uring *ring, struct entry *e, uint32_t op, uint64_t commit, uint16_t qid) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
    char *whole = (char *)sqe; /* 128 bytes: the ring is IORING_SETUP_SQE128, which the type does not say */
    __asm__("" : "+r"(whole)); /* so the compiler does not judge the size by the type */
    memset(whole, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = devfd;
    sqe->cmd_op = op;
    if (op == CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)e->iov;
        sqe->len = 2;
    }
    struct cmd_req c = {.commit_id = commit, .qid = qid};
    memcpy(whole + offsetof(struct io_uring_sqe, cmd), &c, sizeof c);
    io_uring_sqe_set_data(sqe, e);
}

static void answer(struct io_uring *ring, struct entry *e, uint16_t qid) {
    const struct fuse_in_header *ih = (void *)e->hdr->in_out;
    long r = handle(ih, e->hdr->op_in, e->payload, e->payload);
    struct fuse_out_header oh = {.unique = ih->unique, .error = r < 0 ? (int32_t)r : 0};
    memcpy(e->hdr->in_out, &oh, sizeof oh);
    e->hdr->ent.payload_sz = r > 0 ? (uint32_t)r : 0;
    command(ring, e, CMD_COMMIT_AND_FETCH, e->hdr->ent.commit_id, qid);
}

static void *queue(void *arg) {
    uint16_t qid = (uint16_t)(uintptr_t)arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(qid, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    struct io_uring ring;
    int err = io_uring_queue_init((unsigned)entries_per_queue * 2, &ring, IORING_SETUP_SQE128);
    if (err) {
        fprintf(stderr, "io_uring_queue_init: %s\n", strerror(-err));
        exit(1);
    }
    for (int i = 0; i < entries_per_queue; i++) {
        struct entry *e = calloc(1, sizeof *e);
        e->hdr = (void *)page_buffer(4096);
        e->payload = page_buffer(PAYLOAD);
        e->iov[0] = (struct iovec){e->hdr, sizeof *e->hdr};
        e->iov[1] = (struct iovec){e->payload, PAYLOAD};
        command(&ring, e, CMD_REGISTER, 0, qid);
    }
    io_uring_submit(&ring);
    for (;;) {
        struct io_uring_cqe *cqe;
        err = io_uring_wait_cqe(&ring, &cqe);
        if (err == -EINTR) continue;
        if (err) return NULL;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&ring, head, cqe) {
            seen++;
            if (cqe->res == 0) answer(&ring, io_uring_cqe_get_data(cqe), qid);
            else if (cqe->res != -ENOTCONN && cqe->res != -ENODEV) fprintf(stderr, "queue %u: %s\n", qid, strerror(-cqe->res));
        }
        io_uring_cq_advance(&ring, seen);
        io_uring_submit(&ring);
    }
}

static int serve(int threads, const char *backing, const char *mountpoint) {
    backfd = open(backing, O_RDONLY | O_DIRECT);
    if (backfd < 0 || fstat(backfd, &backst)) return perror(backing), 1;
    devfd = open("/dev/fuse", O_RDWR);
    if (devfd < 0) return perror("/dev/fuse"), 1;
    char opts[128];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", devfd);
    if (mount("fuse_floor", mountpoint, "fuse.fuse_floor", MS_NOSUID | MS_NODEV | MS_RDONLY, opts))
        return perror("mount"), 1;
    pthread_t t;
    for (int i = 0; i < (uring_mode ? 1 : threads); i++) pthread_create(&t, NULL, classic, NULL);
    if (uring_mode) {
        entries_per_queue = threads;
        sleep(1); /* the kernel takes registrations once INIT is answered */
        for (long q = 0; q < sysconf(_SC_NPROCESSORS_CONF); q++)
            pthread_create(&t, NULL, queue, (void *)(uintptr_t)q);
    }
    pthread_join(t, NULL);
    return 0;
}

static char *mapped;
static size_t mapped_size;
static double seconds;
static volatile unsigned long sink;

static double since(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t0->tv_sec) + (double)(t.tv_nsec - t0->tv_nsec) / 1e9;
}

static void *toucher(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg * 7919u + 1, sum = 0;
    size_t pages = mapped_size / 4096;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    while (since(&t0) < seconds)
        for (size_t p = (size_t)rand_r(&seed) % pages, end = p + 256; p < end && p < pages; p++)
            sum += (unsigned char)mapped[p * 4096];
    sink += sum;
    return NULL;
}

static int touch(const char *path, int threads) {
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) return perror(path), 1;
    mapped_size = (size_t)st.st_size;
    mapped = mmap(NULL, mapped_size, PROT_READ, MAP_SHARED, fd, 0);
    if (mapped == MAP_FAILED) return perror("mmap"), 1;
    pthread_t t[64];
    for (int i = 0; i < threads && i < 64; i++) pthread_create(&t[i], NULL, toucher, (void *)(uintptr_t)i);
    for (int i = 0; i < threads && i < 64; i++) pthread_join(t[i], NULL);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 5 && !strcmp(argv[1], "touch")) {
        seconds = atof(argv[4]);
        return touch(argv[2], atoi(argv[3]));
    }
    if (argc == 5 && (!strcmp(argv[1], "classic") || !strcmp(argv[1], "uring"))) {
        uring_mode = !strcmp(argv[1], "uring");
        return serve(atoi(argv[2]), argv[3], argv[4]);
    }
    fprintf(stderr, "usage: fuse_floor classic|uring N BACKING MOUNTPOINT | touch FILE THREADS SECONDS\n");
    return 2;
}
