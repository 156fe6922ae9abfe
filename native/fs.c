/* The FUSE handlers: the namespace answered from the tables, reads by drives.c, control files and
 * extended attributes by Python (rare requests). Read-only everywhere. Every handler replies
 * exactly once, with an errno where something failed: nothing here can end the loop.
 */
#define _GNU_SOURCE
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

enum { H_FILE = 1, H_CONTROL };

typedef struct {
    int kind;
    file_t *f;
    char *data; /* control files: the snapshot taken at open */
    size_t len;
    int cached; /* opened without O_DIRECT: its reads fill the page cache (fills answer them) */
    int calls;  /* such an open whose read calls come here as they are (direct_reads) */
    int passed; /* passed through: the kernel reads the primary itself (passthrough.c) */
    int view;   /* the daemon's own open (view.c), not a reader's */
} handle_t;

static engine_t *eng(fuse_req_t req) { return fuse_req_userdata(req); }

node_t *engine_node(engine_t *e, uint64_t ino) {
    size_t lo = 0, hi = e->nnodes;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (e->nodes[mid].ino < ino)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < e->nnodes && e->nodes[lo].ino == ino ? &e->nodes[lo] : NULL;
}

/* The attributes of a node. A control file's size is that of a snapshot now (Python pads each to
 * a size that only grows, so a stat before an open matches it) or, asked through an open file,
 * that file's own snapshot's. */
static int attr_of(engine_t *e, fuse_req_t req, node_t *n, const handle_t *h, struct stat *st) {
    *st = n->st;
    if (n->kind == NODE_CONTROL_FILE) {
        size_t len;
        if (h && h->kind == H_CONTROL) {
            len = h->len;
        } else {
            char *data;
            int err = e->control(e->py, n->ino, fuse_req_ctx(req)->uid, &data, &len);
            if (err)
                return err;
            free(data);
        }
        st->st_size = (off_t)len;
        st->st_blocks = (blkcnt_t)((len + 511) / 512); /* not sparse: cp copies, never pads */
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        st->st_atim = st->st_mtim = st->st_ctim = now;
    }
    return 0;
}

static void op_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    engine_t *e = eng(req);
    node_t *p = engine_node(e, parent);
    if (!p || (p->kind != NODE_DIR && p->kind != NODE_CONTROL_DIR)) {
        fuse_reply_err(req, p ? ENOTDIR : ENOENT);
        return;
    }
    for (uint32_t i = 0; i < p->nchildren; i++) {
        child_t *c = &e->children[p->first_child + i];
        if (strcmp(c->name, name) != 0)
            continue;
        node_t *n = engine_node(e, c->ino);
        struct fuse_entry_param ep;
        memset(&ep, 0, sizeof ep);
        int err = n ? attr_of(e, req, n, NULL, &ep.attr) : ENOENT;
        if (err) {
            fuse_reply_err(req, err);
            return;
        }
        ep.ino = n->ino;
        ep.attr_timeout = ep.entry_timeout = n->timeout;
        fuse_reply_entry(req, &ep);
        return;
    }
    fuse_reply_err(req, ENOENT);
}

static void op_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    engine_t *e = eng(req);
    node_t *n = engine_node(e, ino);
    const handle_t *h = fi && fi->fh ? (const handle_t *)(uintptr_t)fi->fh : NULL;
    struct stat st;
    int err = n ? attr_of(e, req, n, h, &st) : ENOENT;
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_attr(req, &st, n->timeout);
}

static void op_readlink(fuse_req_t req, fuse_ino_t ino) {
    node_t *n = engine_node(eng(req), ino);
    if (!n || n->kind != NODE_LNK)
        fuse_reply_err(req, EINVAL);
    else
        fuse_reply_readlink(req, n->target);
}

static void op_opendir(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    node_t *n = engine_node(eng(req), ino);
    if (!n || (n->kind != NODE_DIR && n->kind != NODE_CONTROL_DIR)) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    fi->fh = ino;
    fuse_reply_open(req, fi);
}

static void op_readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)fi;
    engine_t *e = eng(req);
    node_t *n = engine_node(e, ino);
    if (!n || (n->kind != NODE_DIR && n->kind != NODE_CONTROL_DIR)) {
        fuse_reply_err(req, ENOTDIR);
        return;
    }
    char *buf = malloc(size);
    if (!buf) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    size_t used = 0;
    for (uint32_t i = off < 0 ? 0 : (uint32_t)off; i < n->nchildren; i++) {
        child_t *c = &e->children[n->first_child + i];
        node_t *cn = engine_node(e, c->ino);
        struct stat st;
        memset(&st, 0, sizeof st);
        st.st_ino = c->ino;
        st.st_mode = cn ? cn->st.st_mode : 0;
        size_t need = fuse_add_direntry(req, buf + used, size - used, c->name, &st, (off_t)i + 1);
        if (need > size - used)
            break;
        used += need;
    }
    fuse_reply_buf(req, buf, used);
    free(buf);
}

/* A reader's served open (+1) or release (-1), for fills: a page-cache reader's gets the file a view
 * (view.c); an O_DIRECT reader's keeps fills to the extent asked (fill.c). */
static void count_reader(engine_t *e, const handle_t *h, int delta) {
    if (h->passed || h->view)
        return;
    if (h->cached)
        view_reader(e, h->f, delta);
    else
        atomic_fetch_add(&h->f->direct_opens, delta);
}

static void release_file(engine_t *e, const handle_t *h) {
    count_reader(e, h, -1);
    file_release_kernel(e, h->f, h->passed);
}

/* The kernel's open of a served file, into h: 0 or an errno. */
static int open_file(engine_t *e, fuse_req_t req, file_t *f, handle_t *h, struct fuse_file_info *fi) {
    int32_t backing = 0;
    h->cached = !(fi->flags & O_DIRECT);
    int err = file_open_kernel(e, f, h->cached, &backing);
    if (err)
        return err;
    h->kind = H_FILE;
    h->f = f;
    h->passed = backing > 0;
    h->view = view_is_mine(e, req);
    count_reader(e, h, 1);
    passthrough_reply_next(backing);
    /* The files are immutable: the page cache stays valid across opens. A passed-through open
     * has none of its own (and the kernel refuses it with FOPEN_KEEP_CACHE). */
    fi->keep_cache = !h->passed;
    /* Direct reads: a page-cache open's read calls come here as they are (FOPEN_DIRECT_IO), not as
     * the page cache's 4 KiB pages, which the kernel copies in one at a time and its memory cgroup
     * reclaims one at a time; what it maps still goes through the page cache (the kernel allows it:
     * FUSE_DIRECT_IO_ALLOW_MMAP), and its requests carry no lock owner, a read call's do. Not the
     * daemon's own open (view.c), which maps the file to see its page cache. */
    h->calls = h->cached && !h->passed && !h->view && atomic_load(&e->reads_direct);
    /* An O_DIRECT open of a file open passed through must pass through too (passthrough.c);
     * FOPEN_DIRECT_IO has its reads come here all the same, read as any O_DIRECT read (the
     * backing file would ask the caller for aligned buffers). */
    fi->direct_io = (h->passed && !h->cached) || h->calls;
    return 0;
}

static void op_open(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    engine_t *e = eng(req);
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) {
        fuse_reply_err(req, EROFS);
        return;
    }
    node_t *n = engine_node(e, ino);
    if (!n) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    handle_t *h = calloc(1, sizeof *h);
    if (!h) {
        fuse_reply_err(req, ENOMEM);
        return;
    }
    if (n->kind == NODE_CONTROL_FILE) {
        /* A snapshot per open, read with direct I/O: every reader sees current numbers. */
        int err = e->control(e->py, ino, fuse_req_ctx(req)->uid, &h->data, &h->len);
        if (err) {
            free(h);
            fuse_reply_err(req, err);
            return;
        }
        h->kind = H_CONTROL;
        fi->direct_io = 1;
        fi->keep_cache = 0;
    } else if (n->file >= 0) {
        int err = open_file(e, req, &e->files[n->file], h, fi);
        if (err) {
            free(h);
            fuse_reply_err(req, err);
            return;
        }
    } else {
        free(h);
        fuse_reply_err(req, n->kind == NODE_DIR || n->kind == NODE_CONTROL_DIR ? EISDIR : EINVAL);
        return;
    }
    fi->fh = (uint64_t)(uintptr_t)h;
    int sent = fuse_reply_open(req, fi);
    passthrough_reply_next(0);
    if (sent != 0) { /* the opener is gone (interrupted): nobody will release */
        if (h->kind == H_FILE)
            release_file(e, h);
        free(h->data);
        free(h);
    }
}

static void op_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, struct fuse_file_info *fi) {
    (void)ino; /* the handle holds the file */
    handle_t *h = (handle_t *)(uintptr_t)fi->fh;
    if (h->kind == H_CONTROL) {
        size_t o = off < 0 ? 0 : (size_t)off;
        size_t n = o < h->len ? h->len - o : 0;
        fuse_reply_buf(req, h->data + (o < h->len ? o : h->len), n < size ? n : size);
        return;
    }
    int kind = !h->cached ? READ_DIRECT : h->calls && fi->lock_owner ? READ_CALL : READ_CACHED;
    serve_read(eng(req), req, h->f, size, off, kind);
}

static void op_release(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    (void)ino;
    handle_t *h = (handle_t *)(uintptr_t)fi->fh;
    if (h->kind == H_FILE)
        release_file(eng(req), h);
    free(h->data);
    free(h);
    fuse_reply_err(req, 0);
}

static void op_statfs(fuse_req_t req, fuse_ino_t ino) {
    (void)ino;
    struct statvfs st;
    if (statvfs(eng(req)->roots[0], &st) != 0)
        fuse_reply_err(req, errno ? errno : EIO);
    else
        fuse_reply_statfs(req, &st);
}

static void reply_xattr(fuse_req_t req, int err, char *data, size_t len, size_t size) {
    if (err)
        fuse_reply_err(req, err);
    else if (size == 0)
        fuse_reply_xattr(req, len);
    else if (len > size)
        fuse_reply_err(req, ERANGE);
    else
        fuse_reply_buf(req, data, len);
    free(data);
}

static void op_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size) {
    engine_t *e = eng(req);
    char *data = NULL;
    size_t len = 0;
    int err = e->xattr(e->py, ino, name, &data, &len);
    reply_xattr(req, err, data, len, size);
}

static void op_listxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
    engine_t *e = eng(req);
    char *data = NULL;
    size_t len = 0;
    int err = e->listxattr(e->py, ino, &data, &len);
    reply_xattr(req, err, data, len, size);
}

/* Every write path: a read-only filesystem. */
static void erofs(fuse_req_t req) { fuse_reply_err(req, EROFS); }
static void op_setattr(fuse_req_t req, fuse_ino_t i, struct stat *a, int s, struct fuse_file_info *fi) {
    (void)i, (void)a, (void)s, (void)fi;
    erofs(req);
}
static void op_mknod(fuse_req_t req, fuse_ino_t p, const char *n, mode_t m, dev_t d) {
    (void)p, (void)n, (void)m, (void)d;
    erofs(req);
}
static void op_mkdir(fuse_req_t req, fuse_ino_t p, const char *n, mode_t m) {
    (void)p, (void)n, (void)m;
    erofs(req);
}
static void op_unlink(fuse_req_t req, fuse_ino_t p, const char *n) {
    (void)p, (void)n;
    erofs(req);
}
static void op_symlink(fuse_req_t req, const char *l, fuse_ino_t p, const char *n) {
    (void)l, (void)p, (void)n;
    erofs(req);
}
static void op_rename(fuse_req_t req, fuse_ino_t p, const char *n, fuse_ino_t np, const char *nn,
                      unsigned int f) {
    (void)p, (void)n, (void)np, (void)nn, (void)f;
    erofs(req);
}
static void op_link(fuse_req_t req, fuse_ino_t i, fuse_ino_t np, const char *nn) {
    (void)i, (void)np, (void)nn;
    erofs(req);
}
static void op_write(fuse_req_t req, fuse_ino_t i, const char *b, size_t s, off_t o,
                     struct fuse_file_info *fi) {
    (void)i, (void)b, (void)s, (void)o, (void)fi;
    erofs(req);
}
static void op_create(fuse_req_t req, fuse_ino_t p, const char *n, mode_t m, struct fuse_file_info *fi) {
    (void)p, (void)n, (void)m, (void)fi;
    erofs(req);
}
static void op_setxattr(fuse_req_t req, fuse_ino_t i, const char *n, const char *v, size_t s, int f) {
    (void)i, (void)n, (void)v, (void)s, (void)f;
    erofs(req);
}
static void op_removexattr(fuse_req_t req, fuse_ino_t i, const char *n) {
    (void)i, (void)n;
    erofs(req);
}

const struct fuse_lowlevel_ops colifs_ops = {
    .lookup = op_lookup,
    .getattr = op_getattr,
    .readlink = op_readlink,
    .opendir = op_opendir,
    .readdir = op_readdir,
    .open = op_open,
    .read = op_read,
    .release = op_release,
    .statfs = op_statfs,
    .getxattr = op_getxattr,
    .listxattr = op_listxattr,
    .setattr = op_setattr,
    .mknod = op_mknod,
    .mkdir = op_mkdir,
    .unlink = op_unlink,
    .rmdir = op_unlink,
    .symlink = op_symlink,
    .rename = op_rename,
    .link = op_link,
    .write = op_write,
    .create = op_create,
    .setxattr = op_setxattr,
    .removexattr = op_removexattr,
};
