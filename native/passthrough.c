/* Passthrough for page-cache opens (--passthrough): the kernel reads the primary's file itself
 * (FUSE passthrough, Linux 6.9+), so an mmap or buffered reader gets the primary's own speed with
 * no request, no copy and no daemon CPU. It does not get the mirrors' bandwidth, and what it reads
 * is not counted (the daemon never sees it). PT_ALWAYS passes every page-cache open through;
 * PT_AUTO (the default) only those of a file no mirror holds, while Python says fills would not
 * beat the kernel's own reads (pt_allow: the drives need no depth, colifs.depth): there the
 * daemon could only add its cost to the primary's speed.
 *
 * libfuse 3.14 has no API for it (3.17 has fuse_passthrough_open): two hooks on the session's
 * device I/O (fuse_session_custom_io, libfuse 3.13+) ask for it in the INIT reply (flags2
 * FUSE_PASSTHROUGH, max_stack_depth 1) and set an open reply's FOPEN_PASSTHROUGH and backing id.
 * Both replies are written by the thread that calls fuse_reply_*, so a thread-local tells the hook
 * which open reply to change.
 *
 * The kernel's rules (fs/fuse/iomode.c): while an inode has an open passed through, every other
 * open of it must pass through to the same backing file, and while it has opens served by the
 * daemon, none may pass through (the open fails with EIO otherwise). So the mode is the file's:
 * the first open picks it (passed through if it reads through the page cache), the others follow
 * it while any is open (an O_DIRECT open of a file passed through is one too, with FOPEN_DIRECT_IO:
 * the kernel then sends its reads here all the same). f->lock guards the counts (served_opens,
 * pt_opens) and backing_id. The daemon's count of a mode is never below the kernel's: it counts an
 * open before replying, and the kernel drops an open's mode before it sends its RELEASE.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

/* The kernel's ABI (include/uapi/linux/fuse.h, protocol 7.40): libfuse 3.14 ships none of it. */
struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct init_in {
    uint32_t major, minor, max_readahead, flags, flags2;
};
struct init_out {
    uint32_t major, minor, max_readahead, flags;
    uint16_t max_background, congestion_threshold;
    uint32_t max_write, time_gran;
    uint16_t max_pages, map_alignment;
    uint32_t flags2, max_stack_depth;
    uint16_t request_timeout, unused[11];
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags;
    int32_t backing_id;
};
struct backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define OP_INIT 26
#define INIT_EXT (1u << 30)
#define INIT2_PASSTHROUGH (1u << (37 - 32)) /* FUSE_PASSTHROUGH, in flags2 */
#define INIT2_ALLOW_MMAP (1u << (36 - 32))  /* FUSE_DIRECT_IO_ALLOW_MMAP (Linux 6.6+), in flags2 */
#define OPEN_PASSTHROUGH (1u << 7)          /* FOPEN_PASSTHROUGH */
#define IOC_BACKING_OPEN _IOW(229, 1, struct backing_map)
#define IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

_Static_assert(sizeof(struct in_header) == 40, "fuse_in_header");
_Static_assert(sizeof(struct init_out) == 64, "fuse_init_out");
_Static_assert(sizeof(struct open_out) == 16, "fuse_open_out");

static __thread int32_t open_reply_backing; /* > 0: the open reply this thread writes next passes through */

/* What the mount asked for and the kernel's INIT did not offer, said (errno kept: libfuse reads it
 * after the read this runs in). */
static void not_offered(engine_t *e, int kind, const char *why) {
    int saved = errno;
    e->event(e->py, kind, 0, -1, why, 0, 0, 0);
    errno = saved;
}

/* The INIT request: remember it and what the kernel offers (its reply then asks for what the mount
 * wants of that), say so if passthrough is wanted and not offered. */
static ssize_t io_read(int fd, void *buf, size_t len, void *userdata) {
    engine_t *e = userdata;
    ssize_t n = read(fd, buf, len);
    const struct in_header *h = buf;
    if (n < (ssize_t)(sizeof *h + sizeof(struct init_in)) || h->opcode != OP_INIT)
        return n;
    const struct init_in *in = (const void *)(h + 1);
    uint32_t offered = in->flags & INIT_EXT ? in->flags2 : 0;
    atomic_store(&e->init_offered, offered);
    atomic_store(&e->init_unique, h->unique);
    if (e->passthrough != PT_NEVER && !(offered & INIT2_PASSTHROUGH) && !atomic_exchange(&e->pt_refused, 1))
        not_offered(e, EV_NO_PASSTHROUGH,
                    "the kernel does not offer it (Linux 6.9 or newer with CONFIG_FUSE_PASSTHROUGH)");
    if (e->direct_reads && !(offered & INIT2_ALLOW_MMAP))
        not_offered(e, EV_NO_DIRECT_READS, "the kernel cannot map direct-I/O opens (Linux 6.6 or newer)");
    return n;
}

/* The INIT reply asks for passthrough and for mapping direct-I/O opens (direct_reads: fs.c) where
 * the mount wants them and the kernel offered them. */
static void answer_init(engine_t *e, struct init_out *o) {
    uint32_t offered = atomic_load(&e->init_offered);
    if (e->passthrough != PT_NEVER && (offered & INIT2_PASSTHROUGH)) {
        o->flags |= INIT_EXT;
        o->flags2 |= INIT2_PASSTHROUGH;
        o->max_stack_depth = 1; /* the primary's filesystem may not stack on another */
        atomic_store(&e->ctr.passthrough[0], 1);
    }
    if (e->direct_reads && (offered & INIT2_ALLOW_MMAP)) {
        o->flags |= INIT_EXT;
        o->flags2 |= INIT2_ALLOW_MMAP;
        atomic_store(&e->reads_direct, 1);
        atomic_store(&e->ctr.passthrough[4], 1);
    }
}

static ssize_t io_writev(int fd, struct iovec *iov, int count, void *userdata) {
    engine_t *e = userdata;
    int32_t backing = open_reply_backing;
    open_reply_backing = 0;
    const struct out_header *h = iov[0].iov_base;
    if (count == 2 && iov[0].iov_len == sizeof *h && h->error == 0) {
        uint64_t init = atomic_load(&e->init_unique);
        if (backing > 0 && iov[1].iov_len == sizeof(struct open_out)) {
            struct open_out *o = iov[1].iov_base;
            o->open_flags |= OPEN_PASSTHROUGH;
            o->backing_id = backing;
        } else if (init && h->unique == init && iov[1].iov_len == sizeof(struct init_out)) {
            answer_init(e, iov[1].iov_base);
        }
    }
    return writev(fd, iov, count);
}

int passthrough_setup(engine_t *e) {
#if FUSE_VERSION >= FUSE_MAKE_VERSION(3, 13)
    static const struct fuse_custom_io io = {.read = io_read, .writev = io_writev};
    return -fuse_session_custom_io(e->se, &io, fuse_session_fd(e->se));
#else
    (void)e, (void)io_read, (void)io_writev;
    return ENOTSUP;
#endif
}

/* A backing id for the primary's copy of f (open: f->fd[0] is), or -errno. The kernel opens its
 * own file from it, with each caller's flags. */
static int32_t backing_open(engine_t *e, file_t *f) {
    struct backing_map map = {.fd = atomic_load(&f->fd[0])};
    int id = ioctl(fuse_session_fd(e->se), IOC_BACKING_OPEN, &map);
    return id > 0 ? id : -errno;
}

enum { SERVED, PASSED };

/* Whether a page-cache open of f is to pass through, if the kernel lets it. */
static int wants_passthrough(engine_t *e, file_t *f) {
    return e->passthrough == PT_ALWAYS ||
           (e->passthrough == PT_AUTO && atomic_load(&f->mask) == 1 && atomic_load(&e->pt_allow));
}

/* The mode of a kernel open of f (f->lock held, f open): PASSED or SERVED. A refusal that would
 * repeat (no CAP_SYS_ADMIN, a primary on a stacked filesystem: ELOOP) stops passthrough for the
 * mount, said once in why; running out of descriptors or memory does not. */
static int mode_for(engine_t *e, file_t *f, int cached, char *why, size_t n) {
    if (f->pt_opens > 0)
        return PASSED;
    if (!cached || !wants_passthrough(e, f) || f->served_opens > 0 || atomic_load(&e->pt_refused) ||
        !atomic_load(&e->ctr.passthrough[0]))
        return SERVED;
    int32_t id = backing_open(e, f);
    if (id > 0) {
        f->backing_id = id;
        return PASSED;
    }
    if (id != -EMFILE && id != -ENFILE && id != -ENOMEM && !atomic_exchange(&e->pt_refused, 1))
        snprintf(why, n, "the kernel refused %s/%s as a backing file (%s)", e->roots[0], f->relpath,
                 strerror(-id));
    return SERVED;
}

int file_open_kernel(engine_t *e, file_t *f, int cached, int32_t *backing_id) {
    char why[512] = "";
    notes_t nt = {.n = 0};
    *backing_id = 0;
    pthread_mutex_lock(&f->lock);
    int err = file_open_locked(e, f, &nt); /* a primary not the one mounted is never a backing file */
    if (!err && mode_for(e, f, cached, why, sizeof why) == PASSED) {
        f->pt_opens++;
        *backing_id = f->backing_id;
        if (cached)
            atomic_fetch_add(&e->ctr.passthrough[1], 1);
    } else if (!err) {
        f->served_opens++;
        if (cached && wants_passthrough(e, f))
            atomic_fetch_add(&e->ctr.passthrough[2], 1);
    }
    pthread_mutex_unlock(&f->lock);
    if (!err)
        atomic_fetch_add(&e->ctr.passthrough[3], 1);
    if (why[0])
        e->event(e->py, EV_NO_PASSTHROUGH, 0, -1, why, 0, 0, 0);
    send_notes(e, f, &nt);
    return err;
}

void file_release_kernel(engine_t *e, file_t *f, int passed) {
    pthread_mutex_lock(&f->lock);
    if (!passed) {
        f->served_opens--;
    } else if (--f->pt_opens == 0) {
        ioctl(fuse_session_fd(e->se), IOC_BACKING_CLOSE, &(uint32_t){(uint32_t)f->backing_id});
        f->backing_id = 0;
    }
    pthread_mutex_unlock(&f->lock);
    atomic_fetch_sub(&e->ctr.passthrough[3], 1);
    file_release(e, f);
}

void passthrough_reply_next(int32_t backing_id) { open_reply_backing = backing_id; }
