/* colifs native engine: the per-request path in C, fed immutable tables computed in Python.
 *
 * Python decides (tree, headers, validation, routing, health policy, usage, stats); this code
 * serves: it answers the FUSE requests from the tables on libfuse's multi-threaded loop
 * (clone_fd), reads the drives with O_DIRECT into per-thread aligned buffers, issues the
 * mirror pieces of a request on their drives' threads while the primary pieces are read inline,
 * re-reads from the primary whatever a mirror failed (error, short read, timeout, changed file),
 * and keeps shared counters that Python reads.
 *
 * Files: fs.c (the FUSE handlers), drives.c (per-drive threads and the read fan-out),
 * passthrough.c (page-cache opens the kernel reads from the primary itself),
 * fill.c (page-cache readers: an expert's missing pages read from every drive at once, each piece
 * answering the kernel's request that waits for it or stored into the page cache),
 * module.c (the Python type that builds the tables and runs the loop).
 */
#ifndef COLIFS_ENGINE_H
#define COLIFS_ENGINE_H

#define FUSE_USE_VERSION 312
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#define MAX_REPLICAS 8     /* run tables hold one column per set of usable mirrors: 2^(n-1) */
#define BLOCK 4096         /* O_DIRECT alignment that is safe on every filesystem here */
#define REQUEST (1u << 20) /* the largest FUSE read request (max_pages 256) */
#define REQ_BUF (REQUEST + 2 * BLOCK)
#define CHUNK (1u << 20)   /* stripe unit (colifs.routing.CHUNK) */
#define STRIPE_SLOTS 64    /* length of a stripe sequence (colifs.routing.STRIPE_SLOTS) */
#define NOT_STRIPED (-1)   /* a segment's key is kept whole on one drive */
static inline uint64_t min_u64(uint64_t a, uint64_t b) { return a < b ? a : b; }
static inline uint64_t max_u64(uint64_t a, uint64_t b) { return a > b ? a : b; }
static inline uint64_t align_down_u64(uint64_t n) { return n & ~(uint64_t)(BLOCK - 1); }
static inline uint64_t align_up_u64(uint64_t n) { return (n + BLOCK - 1) & ~(uint64_t)(BLOCK - 1); }
#define FILL_DEPTH 8              /* fill.c: reads in flight per drive (threads) */
#define FILL_PIECE (256u << 10)   /* fill.c: a piece, and a unit of the fills' arena */
#define FILL_RECENT 16             /* fill.c: a file's reads remembered, to tell readahead running on */
#define FD_CLOSED (-1)
#define FD_FAILED (-2) /* a mirror copy that failed to open: not tried again while the file is open
                          (unless its mirror comes back up: engine.epoch) */
#define RETIRED_FDS 8 /* replaced descriptors a file holds while jobs run: past that it keeps the old */
#define RETIRED_SLOTS (2 * RETIRED_FDS) /* room for those and as many of older copy generations */
#define FD_OPENING (-3) /* a drive thread is opening it (without the lock: the open may hang) */
#define FD_CHANGED (-4) /* the copy opened is not the one validated: dropped for the file (until a
                           reload validates it again) */

enum node_kind { NODE_DIR = 1, NODE_REG, NODE_LNK, NODE_CONTROL_DIR, NODE_CONTROL_FILE };

/* Events the read path reports to Python (the health policy and the logs live there). */
enum event_kind {
    EV_MIRROR_FAILED = 1, /* a mirror read or open failed; the primary answered instead */
    EV_MIRROR_CHANGED,    /* a mirror copy changed after mount: dropped for that file */
    EV_PRIMARY_FAILED,    /* the primary failed a read: the caller gets the errno */
    EV_NO_DIRECT,         /* a drive's filesystem refused O_DIRECT: read buffered */
    EV_NO_FDS,            /* a mirror copy could not be opened for want of descriptors */
    EV_NO_PASSTHROUGH,    /* the kernel refused passthrough: page-cache opens are served */
    EV_PRIMARY_CHANGED,   /* the primary's file is not the one mounted: its opens fail (EIO) */
    EV_NO_DIRECT_READS,   /* the kernel cannot map direct-I/O opens: read calls use the page cache */
};

/* What a copy must still be (fstat): the ctime too, as user space cannot set it back (a copy
 * rewritten in place with its mtime restored still shows a new one). colifs.replicas.identity. */
typedef struct {
    uint64_t dev, ino, size;
    int64_t mtime_ns, ctime_ns;
} ident_t;

typedef struct {
    uint64_t ino;
    struct stat st;
    int kind;
    int32_t file;                 /* index into files, or -1 */
    uint32_t first_child, nchildren; /* into engine.children, in readdir order */
    char *target;                 /* symlinks */
    size_t target_len;
    double timeout;               /* attr/entry timeout */
} node_t;

typedef struct {
    char *name;
    uint64_t ino;
} child_t;

/* fill.c: bytes [lo, hi) read at `t` (mono_ns), of key `key`; or, from > 0, a run-on from that key's read,
 * begun at `from`; by a reader that streamed across `hops` boundaries between experts to get there. */
typedef struct {
    uint64_t lo, hi, t, from;
    int32_t key;
    uint32_t hops;
} recent_t;

typedef struct {
    char *relpath;
    uint64_t size;
    _Atomic uint32_t mask;     /* replicas holding a valid copy (bit d: drive d; bit 0 always) */
    _Atomic uint32_t dropped;  /* mirrors changed since mount or reload: not used until a reload */
    /* What each copy must still be (fstat), and its generation: +1 each time a reload changes the
     * copy (file_set_copy). ident[0] is the primary's file at mount: its headers and run table are
     * that file's, so a reopen that finds another is refused (file_open_locked). Lock rules: both
     * change under lock; readers copy ident under lock (a mirror job takes its copy when it is
     * handed out) and load copy_gen without it. */
    ident_t ident[MAX_REPLICAS];
    _Atomic uint32_t copy_gen[MAX_REPLICAS];
    _Atomic int primary_changed; /* the primary was found not the one mounted (said once) */
    /* Run table (colifs.readplan.run_table), independent of the weights: segment i is
     * [start[i], start[i+1]) (the last ends at size), key[i] (-1: header or plain bytes, from the
     * primary), pos[i] its fixed-point routing position, rot[i] its stripe rotation (NOT_STRIPED:
     * whole on one drive). The drive comes from the routes in force (engine.routes). */
    uint32_t nseg;
    uint64_t *seg_start;
    int32_t *seg_key;
    uint32_t *seg_pos;
    int8_t *seg_rot;
    /* Descriptors, shared by all opens of the file and held by every mirror job on it (refs: a
     * descriptor is closed only once no job can still read it, so its number is never reused
     * under a late job). Lock rules: lock guards refs, jobs, retired* and the changes of fd,
     * fd_epoch and fd_drive; readers load fd and fd_epoch without it (a job's ref keeps them
     * valid). A job reads only descriptors of its own copy generation (copy_gen, checked after it
     * loads fd[d]), so each generation's jobs are counted apart: a retired descriptor of the copy
     * in force waits for jobs[d], one of an older copy for that copy's jobs only (retired_readers),
     * and a job stuck in a hung old copy holds up nothing of a newer one. */
    pthread_mutex_t lock;
    pthread_cond_t opened; /* a mirror open finished, or a reload changed a copy */
    int refs;
    _Atomic int fd[MAX_REPLICAS];
    _Atomic int direct[MAX_REPLICAS];
    _Atomic uint32_t fd_epoch[MAX_REPLICAS]; /* engine.epoch[d] when fd[d] was opened (or failed) */
    struct drive *fd_drive[MAX_REPLICAS];  /* the drive generation fd[d] was opened on (its calls) */
    char *changed_why[MAX_REPLICAS]; /* under lock: why an open found copy d changed (FD_CHANGED),
                                        which the jobs that find fd[d] so report too */
    int jobs[MAX_REPLICAS];     /* mirror jobs queued or running on the copy in force, per drive */
    int retired[RETIRED_SLOTS]; /* replaced descriptors: closed once no job of their copy runs */
    uint8_t retired_on[RETIRED_SLOTS];   /* their drive (so another mirror's jobs keep none open) */
    uint32_t retired_gen[RETIRED_SLOTS]; /* their copy generation (copy_gen) */
    int retired_readers[RETIRED_SLOTS];  /* of an older copy than the one in force: its jobs left */
    struct drive *retired_drive[RETIRED_SLOTS]; /* the drive generation each was opened on */
    int nretired;
    /* The kernel's opens of the file, by mode (passthrough.c: all in one mode at a time). */
    int served_opens, pt_opens;
    int32_t backing_id; /* the kernel's id of the primary's copy while pt_opens > 0 */
    uint64_t ino;          /* the node serving it (what a page-cache store names) */
    char *mpath;           /* its path within the mount (view.c opens it there) */
    /* view.c: the daemon's own open of the file, while page-cache readers hold it open (user_opens,
     * under lock): view_fd the view thread's alone, view_map set and read under fills.m. */
    int user_opens, view_fd, view_queued;
    _Atomic int direct_opens; /* O_DIRECT opens served: fills keep to the extent asked (fill.c) */
    char *view_map;
    uint32_t *expert_seg;  /* the segments of routed experts, by key then offset (fill.c) */
    size_t nexpert;
    recent_t recent[FILL_RECENT]; /* fill.c, under fills.m: the last reads of experts, a ring */
    uint32_t nrecent;
} file_t;

struct job;
struct fill;
struct fpiece;

/* A piece of a reading: file bytes [start, end) (BLOCK multiples but at the file's end) from one
 * drive, into dst. Set by the reading: got, status, err (the primary's errno). */
enum {
    RES_OK, RES_FAILED, RES_CHANGED, RES_TIMEOUT,
    RES_NO_FDS, /* the daemon ran out of descriptors */
    RES_STALE,  /* a reload changed the copy while the piece was read: nothing against the mirror */
};
typedef struct {
    uint64_t start, end;
    int drive; /* 0 once the primary read it (also after a mirror failed) */
    int status, err;
    uint32_t gen; /* the mirror copy's generation its job read (file_t.copy_gen) */
    char *dst;
    ssize_t got;
} piece_t;

/* What a reading reports to Python (colifs.native: health, logs): events, one per kind and drive. */
#define MAX_NOTES 16
typedef struct {
    size_t n;
    struct {
        int kind, drive, timed_out;
        uint32_t gen; /* the copy's generation the reading used (file_t.copy_gen) */
        char what[200];
    } v[MAX_NOTES];
} notes_t;

/* What a reading (drives.c read_pieces) does besides reading: ready(arg, i) once piece i holds its
 * bytes; when mirror pieces time out, abandon() moves what must survive away from the memory the
 * late jobs still write into (it runs before any of them can finish) and names the argument of
 * release(), which runs once they all have. Bytes in [count_from, count_to) count as served. */
typedef struct {
    void (*ready)(void *arg, size_t i);
    int (*abandon)(void *arg, piece_t *pc, size_t n, void **release_arg);
    void (*release)(void *arg);
    void *arg;
    int reread_timeouts; /* timed-out pieces too are read from the primary (abandon moved them) */
    int waited;          /* an O_DIRECT reader waits for all of it, and it may use several drives:
                            its pieces count in the drives' time alone (drives.c waiting_on) */
    int via_cache;       /* a read call's bytes: read through the drives' page caches (fs.c) */
    uint64_t count_from, count_to;
} reading_t;

/* How one set of usable mirrors (a column: bit d-1 = mirror d) routes, from the weights in force
 * (colifs.readplan.route_columns): drive d serves positions in [bound[d-1], bound[d]), stripe
 * chunk c goes to seq[(c + rotation) % STRIPE_SLOTS]. Python rewrites them while requests read
 * them, under a sequence lock (engine.routes_gen, odd while a rewrite runs; one writer: the GIL):
 * a request copies its column whole, again if a rewrite ran meanwhile, so it routes by one table;
 * and it never picks a drive outside its column whatever it read (drives.c segment_drive). */
typedef struct {
    _Atomic uint64_t bound[MAX_REPLICAS];
    _Atomic uint8_t seq[STRIPE_SLOTS];
} route_t;

struct engine;

/* Busy time: while `running` > 0 (reads running), since `since`; under m. */
typedef struct {
    pthread_mutex_t m;
    int running;
    uint64_t since;
} activity_t;

/* One generation of a mirror's slot (drives.c): the directory it reads, its threads and their
 * queue, and the calls into that directory's filesystem under way. A slot gets a new generation
 * when its mirror is removed and when another directory takes its place (drive_renew): the old
 * one's threads finish what they hold (a call stuck in a hung drive too) and end; the new one
 * has threads, queue, counts and busy time of its own, so nothing of it waits for the old one
 * (old jobs left in the old queue are judged stale: their copies were taken out first).
 * Lock rules: m guards head, tail, stop, queued and busy; in_calls and retired are atomics;
 * e, slot, number, root and older never change; a generation is freed with the engine only (a
 * stuck thread, or a descriptor opened on it, may still name it). */
typedef struct drive {
    struct engine *e;
    int slot;
    uint32_t number;           /* the slot's generations count from 1 */
    const char *root;          /* one of the engine's root strings (kept until it is freed) */
    pthread_mutex_t m;
    pthread_cond_t c;
    struct job *head, *tail;
    int stop;                  /* retired: its threads end once its queue is empty */
    uint64_t queued;           /* its jobs' share of e->queued[slot] and ctr.drive_busy[slot]: */
    int busy;                  /* taken out of those when it is retired (they are the slot's) */
    _Atomic int in_calls;      /* threads inside an open, pread, fstat or close on it now */
    _Atomic int retired;       /* set once a newer generation serves the slot */
    activity_t act;            /* its reads' busy time, the slot's only while it is in force */
    pthread_t *threads;
    int nthreads, joined;      /* threads started; of those, joined (retired generations) */
    struct drive *older;       /* the slot's generation before this one */
} drive_t;

/* A fill thread (fill.c): the store thread, or one of a drive's readers. A reader belongs to the
 * drive's reader generation it was started in (fills.rgen): a newer one (a removed mirror's slot
 * renewed) ends it at its next look, so no piece of a newer copy waits behind it. */
typedef struct fill_worker {
    struct engine *e;
    int drive;    /* -1: the store thread */
    uint32_t gen; /* fills.rgen[drive] when it started */
    pthread_t thread;
    struct fill_worker *next; /* fills.workers: freed once joined (at a renewal, or fills_stop) */
} fill_worker_t;

/* Counters, read by Python through memoryviews (64-bit aligned: plain loads are atomic). */
typedef struct {
    _Atomic uint64_t *drive_bytes, *drive_reads, *drive_errors, *drive_busy;
    _Atomic uint64_t *drive_busy_ns;      /* time with a read running on the drive (its rate's base) */
    _Atomic uint64_t *drive_alone_ns;     /* time the drive alone had reads an O_DIRECT reader waits
                                             for, the others none (drives.c waiting_on) */
    _Atomic uint64_t *drive_spilled;      /* bytes the routes gave the drive that went to another
                                             (--routing queue: it had a backlog) */
    _Atomic uint64_t *fallbacks;          /* [0] fallbacks, [1] late mirror jobs skipped unread */
    _Atomic uint64_t *key_bytes;          /* nkeys x nrep: bytes routed per key and drive */
    _Atomic uint64_t *key_reads;          /* nkeys */
    _Atomic uint64_t *file_bytes, *file_reads; /* nfiles */
    _Atomic uint64_t *drive_ok;           /* successful mirror reads: health needs "in a row" */
    _Atomic uint64_t *fill;               /* fill.c: [0] fills started, [1] bytes read into them, [2]
                                             requests answered from one, [3] of them waited for a
                                             piece, [4] bytes answered, [5] bytes held now, [6] fills
                                             not started (the budget was spent), [7] bytes stored into
                                             the page cache, [8] bytes left out as cached already,
                                             [9] views open now (view.c), [10] the last errno a
                                             view met (0: none), [11] bytes a store failed, [12] the
                                             last errno a store met, [13] requests that gave up on
                                             a fill (a piece failed or was late), [14] bytes of
                                             pieces that failed, [15] requests into an expert that
                                             started no fill: they ran on from another key's read,
                                             [16] leads a reader went on into: the rest started,
                                             [17] fills begun on an expert's first page: the rest
                                             of the expert from the start, no lead, [18] bytes
                                             read calls asked for (direct_reads), [19] bytes a
                                             read call's fill read that no call asked for in
                                             HOLD_NS: dropped, [20] fills of a whole expert for a
                                             reader streaming through the file (STREAM_HOPS) */
    _Atomic uint64_t *passthrough;        /* passthrough.c: [0] 1 once asked for at INIT (the kernel
                                             offered it), [1] page-cache opens passed through, [2]
                                             page-cache opens served (their file was open for served
                                             reads, or refused), [3] file opens now (released:
                                             the kernel's RELEASE, which follows close() a moment later),
                                             [4] 1 once direct reads were asked for at INIT (fs.c) */
} counters_t;

typedef struct engine {
    /* Replicas served, and route columns (2^(nrep-1)): they grow while serving (add_drive, a
     * mirror joins), under the routes' sequence lock; per-drive arrays and counters are sized for
     * MAX_REPLICAS from the start, so nothing moves. A reader that loads the old count sees a
     * column whose bounds end at the old last drive: the same routes. */
    _Atomic int nrep, ncols;
    char *_Atomic roots[MAX_REPLICAS]; /* a mirror's changes (set_root) only while none of its
                                           copies is in use; the old string is kept until close:
                                           a drive thread may be building a path from it */
    int direct_io;             /* open the drives O_DIRECT (fallback to buffered per file system) */
    double mirror_timeout;     /* seconds; 0: wait for ever */
    int fuse_threads, drive_threads;
    _Atomic uint32_t up;       /* drives in the routing (bit d); the primary's bit is always set */
    _Atomic uint32_t epoch[MAX_REPLICAS]; /* +1 each time a mirror comes back up (a check read
                                             passed): descriptors opened before are opened again */
    _Atomic uint32_t no_direct_warned;
    uint8_t *key_expert;       /* nkeys: 1 for routed experts (the keys fills work on) */
    int passthrough;           /* PT_NEVER, PT_AUTO, PT_ALWAYS: which page-cache opens pass through
                                  to the primary (passthrough.c) */
    _Atomic int pt_allow;      /* PT_AUTO: Python found nothing to beat the primary read by the kernel
                                  for a file no mirror holds (no fills: its drives need no depth) */
    int queue_routing;         /* each piece to the drive that reads it first (drives.c quickest) */
    _Atomic uint64_t queued[MAX_REPLICAS]; /* bytes handed to each drive and not read yet */
    _Atomic uint64_t speed[MAX_REPLICAS];  /* bytes/s each drive delivered lately (Python measures; 0: not known) */
    int direct_reads;          /* read calls of page-cache opens come here as they are (fs.c) */
    _Atomic int reads_direct;  /* the kernel lets such opens be mapped: direct_reads in force */
    _Atomic uint64_t init_unique; /* the INIT request, if it offered what the mount asks for */
    _Atomic uint32_t init_offered; /* its flags2 */
    _Atomic int pt_refused;    /* the kernel refused a backing file: never asked again */

    node_t *nodes;             /* sorted by ino */
    size_t nnodes;
    child_t *children;
    size_t nchildren;
    file_t *files;
    size_t nfiles;
    size_t nkeys;

    counters_t ctr;
    route_t routes[1 << (MAX_REPLICAS - 1)]; /* ncols */
    _Atomic uint64_t routes_gen;              /* the routes' sequence lock */
    activity_t primary_act;   /* the primary's reads, for drive_busy_ns[0] (a mirror's: drive_t.act) */
    struct {
        pthread_mutex_t m;
        int pending[MAX_REPLICAS];
        uint64_t since;
    } waiting; /* pieces of waited-for readings not read yet, per drive, for drive_alone_ns */

    drive_t *_Atomic drives[MAX_REPLICAS]; /* each mirror slot's generation in force (NULL: none,
                                              the primary's); older ones hang off it (older) */
    int threads_left;          /* drive threads detached stuck in a read: the tables must outlive them */
    struct fuse_session *se;
    char *mountpoint;
    pthread_t loop_thread;
    _Atomic int looping;

    /* fill.c. Lock rules: fills.m guards the list, the queues, held, every fill's refs, left, lead
     * and retry, and every piece's state and asked pages; a piece's bytes are written only while it
     * is P_READING (set under the lock) and read only once it is P_LANDED. */
    struct {
        pthread_mutex_t m;
        pthread_cond_t landed;                /* a piece landed or failed */
        pthread_cond_t work[MAX_REPLICAS];    /* a piece queued on the drive */
        pthread_cond_t store;                 /* a piece to store */
        pthread_cond_t stored;                /* the store in progress finished */
        int storing, no_store;                /* a store runs; none from now on (fill_quiesce) */
        struct fill *list;
        struct fpiece *head[MAX_REPLICAS], *tail[MAX_REPLICAS];
        struct fpiece *store_head, *store_tail;
        size_t budget;                        /* bytes fills may hold: the arena */
        char *arena;                          /* nunits pieces of FILL_PIECE, mapped once */
        uint32_t *free_units;
        size_t nunits, nfree;
        int stop;
        fill_worker_t *workers;               /* every one started, newest first */
        int nworkers;
        int readers[MAX_REPLICAS];            /* drive threads per drive, of its reader generation in
                                                 force (a piece of a drive with none is read from the
                                                 primary) */
        uint32_t rgen[MAX_REPLICAS];          /* each drive's reader generation (fill_drive_renew) */
        _Atomic int paused;                   /* by Python, while memory is short: no new fills */
    } fills;

    /* view.c. Lock rules: views.m guards the queue and every file's view_queued; the clone, nviews
     * and the files' view_fd are the view thread's alone. */
    struct {
        pthread_mutex_t m;
        pthread_cond_t c;
        file_t **queue; /* files whose view is to be opened or closed (each at most once) */
        size_t nqueued;
        int on, started, stop;
        pthread_t thread;
        _Atomic pid_t tid;   /* the view thread's: its opens are views, not readers */
        int clone, nviews;   /* the detached clone of the mount the views are opened in */
    } views;

    /* Calls into Python: rare requests (control files, xattrs) and events. Set by module.c. */
    void *py;
    /* uid: the caller's; the daemon's owner gets a fresh snapshot, other users a shared recent one */
    int (*control)(void *py, uint64_t ino, uint32_t uid, char **data, size_t *len);
    int (*xattr)(void *py, uint64_t ino, const char *name, char **data, size_t *len);
    int (*listxattr)(void *py, uint64_t ino, char **data, size_t *len);
    void (*event)(void *py, int kind, int drive, int32_t file, const char *text, int timed_out,
                  uint64_t successes, uint32_t gen); /* gen: the copy's generation (EV_MIRROR_CHANGED) */
} engine_t;

/* fs.c */
extern const struct fuse_lowlevel_ops colifs_ops;
node_t *engine_node(engine_t *e, uint64_t ino);

/* drives.c */
int drives_start(engine_t *e);
int drive_start(engine_t *e, int d); /* slot d's first generation, reading e->roots[d] */
/* Slot d (a mirror's) gets a new generation reading `root` (NULL: the same directory), its threads
 * started; the one in force is retired (*retired: its number). 0 or an errno (nothing changed). */
int drive_renew(engine_t *e, int d, const char *root, uint32_t *retired);
int drive_calls(engine_t *e, int d, uint32_t number); /* threads in a call on that generation now */
void drives_stop(engine_t *e);
void drives_free(engine_t *e); /* with the engine, once no thread of ours runs */
/* What a read request is: an O_DIRECT reader's, the page cache's (readahead, a fault), or a read
 * call of a page-cache open the kernel passed on as it is (direct_reads: fs.c). */
enum { READ_DIRECT, READ_CACHED, READ_CALL };
void serve_read(engine_t *e, fuse_req_t req, file_t *f, size_t size, off_t off, int kind);
size_t runs_bound(const file_t *f, uint64_t start, uint64_t end);
int quickest_drive(engine_t *e, file_t *f); /* drives.c: for a piece a request waits for, or -1 */
enum { PLAN_PRIMARY = 1, PLAN_KEYS_LATER = 2 }; /* plan_runs' how: all on the primary; count no key */
size_t plan_runs(engine_t *e, file_t *f, uint64_t start, uint64_t end, uint64_t stop, uint64_t off,
                 int how, piece_t *runs);
void count_span(engine_t *e, const file_t *f, uint64_t start, uint64_t end, int d, int32_t *last_key);
/* Read the pieces (their dst set): mirrors on their drives' threads, the primary inline, failed
 * mirror pieces again from the primary (in place); timed-out ones too with how->reread_timeouts,
 * else they are left RES_TIMEOUT (their memory is the late jobs'). 0, or the errno the caller
 * gets. What failed is noted in nt, for send_notes once the caller holds no lock and has replied. */
int read_pieces(engine_t *e, file_t *f, piece_t *pc, size_t n, const reading_t *how, notes_t *nt);
void send_notes(engine_t *e, file_t *f, notes_t *nt);
void note_timeout(engine_t *e, notes_t *nt, int drive, uint64_t off); /* a mirror gave no answer in time */
/* One piece read on the calling thread from its drive (a mirror's checked as its jobs are, and read
 * again from the primary if it failed); its bytes were counted in e->queued at hand-out. 0, or the
 * primary's errno. */
int read_piece_here(engine_t *e, file_t *f, piece_t *pc, const reading_t *how, notes_t *nt);
uint64_t mono_ns(void);

/* fill.c */
int fill_init(engine_t *e, size_t budget); /* the files' expert index; budget 0: no fills */
int fills_start(engine_t *e);              /* at mount: the store thread, FILL_DEPTH per drive */
void fill_quiesce(engine_t *e);            /* before the loop is told to stop: no more stores, the
                                              one in progress finished (its request is answered) */
int fill_drive_start(engine_t *e, int d);  /* a mirror joined */
/* Mirror slot d was renewed (drive_renew): its readers of the old generation end at their next
 * look (a stuck one when its call returns), FILL_DEPTH new ones start, and a request waiting for a
 * piece an old one still reads reads it from the primary at once. 0 or an errno. */
int fill_drive_renew(engine_t *e, int d);
void fills_stop(engine_t *e);
void fill_pause(engine_t *e, int paused);
void fill_free_arena(engine_t *e); /* after the loop */
/* 1: answered from a fill; 0: not in one (serve it); -1: in one whose piece failed or is late
 * (read it from the primary). */
int fill_serve(engine_t *e, fuse_req_t req, file_t *f, uint64_t off, uint64_t asked, int call);
int file_open(engine_t *e, file_t *f);
/* f->lock held. A first open (refs 0) opens the primary, refused (EIO) if it is not the file
 * mounted; that is noted in nt once per file, for send_notes once the lock is dropped. */
int file_open_locked(engine_t *e, file_t *f, notes_t *nt);
void file_release(engine_t *e, file_t *f);
int open_backing(engine_t *e, int drive, const char *root, const char *relpath, int *direct);
int set_routes(engine_t *e, const uint8_t *data, size_t len); /* 0, or -1 when they are invalid */
/* One more mirror, drive e->nrep (its root set, its threads started): the routes for the new
 * count in force, then the count; 0, -1 when the routes are invalid, or an errno. */
int add_drive(engine_t *e, const uint8_t *routes, size_t len);
/* A reload's verdict on f's copy on drive d (d > 0): valid as `ident` (NULL: not usable). The
 * descriptor held for the old copy retires (closed once none of the old copy's jobs reads it; the
 * new copy's never wait for it, nor for its open under way). 0, or EBUSY when f holds too many
 * retired descriptors already (try again once its jobs are done). */
int file_set_copy(file_t *f, int d, const ident_t *ident);
uint32_t segment_at(const file_t *f, uint64_t off); /* the run-table segment holding off */

void prefetch_after(engine_t *e, file_t *f, uint64_t ino, uint64_t off, uint64_t asked);

/* view.c */
int views_init(engine_t *e);  /* after fill_init and the tables */
int views_start(engine_t *e); /* at mount */
void views_stop(engine_t *e); /* after the session ended: the views' closes need no answer */
int view_is_mine(engine_t *e, fuse_req_t req);      /* an open by the view thread */
void view_reader(engine_t *e, file_t *f, int delta); /* a page-cache reader's open (+1), release (-1) */
/* Which pages of [a, b) the page cache holds (vec[i] & 1), via f's view (fills.m held; BLOCK is the
 * page size): the pages looked at, 0 when f has no view. */
size_t view_cached(const file_t *f, uint64_t a, uint64_t b, unsigned char *vec);

/* passthrough.c */
enum { PT_NEVER, PT_AUTO, PT_ALWAYS };
/* After fuse_session_mount, if passthrough or direct_reads may be asked for at INIT: 0 or an errno. */
int passthrough_setup(engine_t *e);
/* A kernel open of f: whether it passes through (*backing_id > 0, for passthrough_reply_next) or is
 * served; either holds a descriptor reference (file_open). 0 or an errno. */
int file_open_kernel(engine_t *e, file_t *f, int cached, int32_t *backing_id);
void file_release_kernel(engine_t *e, file_t *f, int passed);
void passthrough_reply_next(int32_t backing_id); /* the open reply this thread writes next; 0: none */

#endif
