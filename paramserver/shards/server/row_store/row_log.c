/* The row store's log-structured engine: records of one size keyed by int64 ids, appended to segment files.

   Loaded with ctypes by row_log.py (built by setup.py at install time, else on first use by paramserver/native.py,
   digest-checked); the caller releases the GIL.  Linux only (O_DIRECT, pthreads).  No Python.h.

   - An in-memory index, id -> location: open addressing with linear probing, 16 bytes a slot (the id, the
     location packed as segment << 40 | offset), doubled when 5/8 full, backward-shift deletion (no tombstones).
   - Segment files segment-NNNNNNNN.log under the folder, each a run of write buffers (buffer_bytes each, so a
     buffer's records sit at fixed offsets and none spans two buffers), each record [int64 id][record bytes].  A
     record on disk is current iff the index points at it; nothing else marks a stale one.
   - put copies records into the current write buffer and points the index at them (their final place in the
     file); a full buffer goes to the writer thread (one buffer in flight, double buffering), which writes it
     with O_DIRECT where the filesystem allows it; a segment is sealed when its last buffer is written, and the
     next one begins.  get sees records still in a buffer (copied from memory).
   - get resolves every id under the lock, then reads the records from disk, sorted by location, each an
     O_DIRECT read of the aligned blocks that hold it: on the kernel's asynchronous I/O (io_submit, QUEUE_DEPTH
     reads in flight from the calling thread, QUEUES gets at once) where asked and the kernel allows it, else in
     parallel on a pool of threads, into per-thread buffers.
   - Compaction, on its own thread (and synchronously in paramserver_row_log_compact): when the files hold more
     than twice the live bytes and more than two segments, the sealed segment with the fewest live bytes (at
     most half live) has its current records appended again through the write buffer, and its file is deleted.
     A reader holds the files' read lock while it reads, so no file it resolved goes away under it.
   - scan walks the segments in order, a chunk of a file at a time (plus the buffers in memory), and gives the
     records the index points at; compaction waits while a scan is open.
   - Errors are returned as -errno with the path concerned (paramserver_row_log_error_path).  A failed write is
     sticky: every later put, delete, flush and compaction returns it; gets are still answered.

   The store is never reopened: its index is in memory only (a shard's checkpoint and push log are the durable
   copy, and its store is made again from them). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/aio_abi.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef PARAMSERVER_KERNEL_DIGEST
#define PARAMSERVER_KERNEL_DIGEST "unknown"
#endif

/* A digest of this file, set by whoever builds it: native.py loads a build only if it matches the source. */
const char *paramserver_kernel_digest(void) { return PARAMSERVER_KERNEL_DIGEST; }

/* One build only (no vector code): native.py asks every build this. */
int paramserver_cpu_has_avx2(void) { return 0; }

#define ALIGN 4096
/* Reads in flight at once on the kernel's asynchronous I/O (O_DIRECT files only), for each of QUEUES gets at
   once (a step's reads beside the reads ahead of the next). */
#define QUEUE_DEPTH 128
#define QUEUES 2
#define EMPTY UINT64_MAX
#define OFFSET_BITS 40
#define MAX_SEGMENTS (1LL << (64 - OFFSET_BITS - 1))
#define PATH_BYTES 4096
#define FOLDER_BYTES (PATH_BYTES - 64) /* room for a segment's name after it */
/* paramserver_row_log_stats's counters, in row_log.py's order. */
enum { STAT_ROWS, STAT_DISK_BYTES, STAT_READS, STAT_READ_BYTES, STAT_WRITES, STAT_WRITTEN_BYTES, STAT_COMPACTIONS,
       STAT_LIVE_BYTES, STAT_SEGMENTS, STAT_DIRECT, STAT_ASYNCHRONOUS, STAT_INDEX_MEMORY, STAT_BUFFER_MEMORY,
       STAT_COUNT };

static inline uint64_t pack(int64_t segment, int64_t offset) {
    return ((uint64_t)segment << OFFSET_BITS) | (uint64_t)offset;
}
static inline int64_t loc_segment(uint64_t loc) { return (int64_t)(loc >> OFFSET_BITS); }
static inline int64_t loc_offset(uint64_t loc) { return (int64_t)(loc & ((1ULL << OFFSET_BITS) - 1)); }
static inline int64_t round_up(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

/* ---- the index ---- */

typedef struct {
    int64_t key;
    uint64_t loc; /* EMPTY: a free slot */
} slot_t;

typedef struct {
    slot_t *slots;
    uint64_t mask;
    int64_t count;
} index_t;

static inline uint64_t mix(int64_t key) {
    uint64_t h = (uint64_t)key;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static int index_init(index_t *index, uint64_t capacity) {
    index->slots = malloc(capacity * sizeof(slot_t));
    if (!index->slots) return -ENOMEM;
    for (uint64_t i = 0; i < capacity; i++) index->slots[i].loc = EMPTY;
    index->mask = capacity - 1;
    index->count = 0;
    return 0;
}

static uint64_t index_find(const index_t *index, int64_t key) {
    for (uint64_t i = mix(key) & index->mask;; i = (i + 1) & index->mask) {
        const slot_t *slot = &index->slots[i];
        if (slot->loc == EMPTY) return EMPTY;
        if (slot->key == key) return slot->loc;
    }
}

/* Points key at loc; returns where it pointed before (EMPTY: it was not held).  Room is made beforehand. */
static uint64_t index_set(index_t *index, int64_t key, uint64_t loc) {
    for (uint64_t i = mix(key) & index->mask;; i = (i + 1) & index->mask) {
        slot_t *slot = &index->slots[i];
        if (slot->loc == EMPTY) {
            slot->key = key;
            slot->loc = loc;
            index->count++;
            return EMPTY;
        }
        if (slot->key == key) {
            uint64_t old = slot->loc;
            slot->loc = loc;
            return old;
        }
    }
}

/* Room for one more key: doubles the table when it would be more than 5/8 full. */
static int index_reserve(index_t *index) {
    uint64_t capacity = index->mask + 1;
    if ((uint64_t)(index->count + 1) * 8 <= capacity * 5) return 0;
    index_t grown;
    int rc = index_init(&grown, capacity * 2);
    if (rc) return rc;
    for (uint64_t i = 0; i < capacity; i++)
        if (index->slots[i].loc != EMPTY) index_set(&grown, index->slots[i].key, index->slots[i].loc);
    free(index->slots);
    *index = grown;
    return 0;
}

/* Removes key; returns where it pointed (EMPTY: not held).  The keys after it in its run shift back. */
static uint64_t index_erase(index_t *index, int64_t key) {
    uint64_t i = mix(key) & index->mask;
    for (;; i = (i + 1) & index->mask) {
        if (index->slots[i].loc == EMPTY) return EMPTY;
        if (index->slots[i].key == key) break;
    }
    uint64_t old = index->slots[i].loc;
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & index->mask;; j = (j + 1) & index->mask) {
        slot_t *slot = &index->slots[j];
        if (slot->loc == EMPTY) break;
        uint64_t home = mix(slot->key) & index->mask;
        /* slot j may move back to the hole unless its home lies cyclically in (hole, j] */
        int stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!stays) {
            index->slots[hole] = *slot;
            hole = j;
        }
    }
    index->slots[hole].loc = EMPTY;
    index->count--;
    return old;
}

/* ---- the store ---- */

typedef struct {
    int fd;
    int64_t live;      /* bytes of the records the index points at */
    int64_t extent;    /* bytes written to the file */
    int64_t full_end;  /* end of the last whole buffer written: bytes before it never change */
    int64_t end;       /* end of the buffers given out */
    int sealed;        /* every buffer written: a candidate for compaction */
    int dirty;         /* written since the last fsync */
} segment_t;

typedef struct {
    uint8_t *data;
    int64_t segment;
    int64_t base; /* offset of the buffer in its segment */
    int64_t used;
} buffer_t;

typedef struct {
    int fd;
    int64_t segment;
    uint64_t loc;
    uint8_t *out;
    int64_t id;
} read_item_t;

typedef struct store store_t;

typedef struct {
    store_t *store;
    pthread_t *threads;
    int count; /* pool threads; the caller works as one more */
    int started;
    pthread_mutex_t mu;
    pthread_cond_t start, done;
    pthread_mutex_t call; /* one get's reads at a time */
    uint64_t generation;
    int stop;
    read_item_t *items;
    int64_t n;
    int64_t next;
    int active;
    int error;
    int64_t error_segment;
    uint8_t **buffers; /* count + 1, aligned */
    int aio; /* whether gets read on the kernel's asynchronous I/O (else the threads read) */
    aio_context_t queues[QUEUES];
    int queue_busy[QUEUES];
    pthread_cond_t queue_free;
    uint8_t *queue_buffers; /* QUEUE_DEPTH of them a queue, aligned */
    int64_t queue_buffer_bytes;
} pool_t;

struct store {
    char folder[FOLDER_BYTES];
    int64_t record_bytes, rec, buffer_bytes, segment_bytes, per_buffer;
    int direct;
    int asynchronous; /* asked to read O_DIRECT files on the kernel's asynchronous I/O */
    pthread_mutex_t mu;
    pthread_rwlock_t files; /* readers of segment files hold it; deleting one takes it for writing */
    pthread_cond_t writer_wake, writer_done, compact_wake, scans_done;
    index_t index;
    segment_t **segments;
    int64_t segment_capacity, segment_count; /* segment ids given out: 0 .. segment_count - 1 */
    buffer_t cur, pend;
    int pend_full;
    int error;
    char error_path[PATH_BYTES];
    pthread_mutex_t error_mu;
    int stop;
    int scans, compacting, compact_wanted;
    pthread_mutex_t compact_mu; /* one compaction at a time */
    pthread_t writer, compactor;
    int writer_started, compactor_started;
    int64_t stats[STAT_COUNT];
    int64_t live_total;
    uint8_t *compact_chunk;
    pool_t pool;
};

static void segment_path(const store_t *s, int64_t segment, char *path) {
    snprintf(path, PATH_BYTES, "%s/segment-%08lld.log", s->folder, (long long)segment);
}

/* Returns rc (< 0) after noting the path it concerns. */
static int fail_path(store_t *s, int rc, const char *path) {
    pthread_mutex_lock(&s->error_mu);
    snprintf(s->error_path, PATH_BYTES, "%s", path);
    pthread_mutex_unlock(&s->error_mu);
    return rc;
}

static int fail_segment(store_t *s, int rc, int64_t segment) {
    char path[PATH_BYTES];
    segment_path(s, segment, path);
    return fail_path(s, rc, path);
}

/* Writes (``writing``) or reads all of bytes at offset, through short transfers and EINTR; a read past the end
   of the file is an error (EIO). */
static int transfer_all(int fd, uint8_t *data, int64_t bytes, int64_t offset, int writing) {
    while (bytes > 0) {
        ssize_t done = writing ? pwrite(fd, data, (size_t)bytes, offset) : pread(fd, data, (size_t)bytes, offset);
        if (done < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (done == 0) return -EIO;
        data += done;
        bytes -= done;
        offset += done;
    }
    return 0;
}

static int write_all(int fd, const uint8_t *data, int64_t bytes, int64_t offset) {
    return transfer_all(fd, (uint8_t *)data, bytes, offset, 1);
}

static int read_all(int fd, uint8_t *data, int64_t bytes, int64_t offset) {
    return transfer_all(fd, data, bytes, offset, 0);
}

static void *aligned(int64_t bytes) {
    void *memory = NULL;
    if (posix_memalign(&memory, ALIGN, (size_t)bytes)) return NULL;
    memset(memory, 0, (size_t)bytes);
    return memory;
}

/* Opens a new segment file (with O_DIRECT where the filesystem takes it). */
static int segment_create_locked(store_t *s, int64_t *created) {
    if (s->segment_count >= MAX_SEGMENTS) return fail_path(s, -EFBIG, s->folder);
    if (s->segment_count == s->segment_capacity) {
        int64_t capacity = s->segment_capacity * 2;
        segment_t **grown = realloc(s->segments, (size_t)capacity * sizeof(segment_t *));
        if (!grown) return fail_path(s, -ENOMEM, s->folder);
        memset(grown + s->segment_capacity, 0, (size_t)(capacity - s->segment_capacity) * sizeof(segment_t *));
        s->segments = grown;
        s->segment_capacity = capacity;
    }
    char path[PATH_BYTES];
    int64_t id = s->segment_count;
    segment_path(s, id, path);
    segment_t *segment = calloc(1, sizeof(segment_t));
    if (!segment) return fail_path(s, -ENOMEM, path);
    int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
    int fd = s->direct ? open(path, flags | O_DIRECT, 0644) : -1;
    if (fd < 0 && (!s->direct || errno == EINVAL)) {
        if (s->direct) s->direct = 0; /* this filesystem takes no O_DIRECT (tmpfs): page-cached files */
        fd = open(path, flags, 0644);
    }
    if (fd < 0) {
        int rc = -errno;
        free(segment);
        return fail_path(s, rc, path);
    }
    segment->fd = fd;
    s->segments[id] = segment;
    s->segment_count++;
    s->stats[STAT_SEGMENTS]++;
    *created = id;
    return 0;
}

static inline segment_t *segment_at(const store_t *s, int64_t id) {
    return id >= 0 && id < s->segment_count ? s->segments[id] : NULL;
}

/* Where the record at (segment, offset) is in memory (a write buffer), or NULL: on disk. */
static inline const uint8_t *in_memory(const store_t *s, int64_t segment, int64_t offset) {
    if (segment == s->cur.segment && offset >= s->cur.base && offset < s->cur.base + s->cur.used)
        return s->cur.data + (offset - s->cur.base);
    if (s->pend_full && segment == s->pend.segment && offset >= s->pend.base && offset < s->pend.base + s->pend.used)
        return s->pend.data + (offset - s->pend.base);
    return NULL;
}

static inline int compaction_due_locked(const store_t *s) {
    int64_t disk = s->stats[STAT_DISK_BYTES];
    return disk > 2 * s->live_total && disk > 2 * s->segment_bytes;
}

static void wake_compactor_locked(store_t *s) {
    if (compaction_due_locked(s) && !s->compact_wanted) {
        s->compact_wanted = 1;
        pthread_cond_signal(&s->compact_wake);
    }
}

/* Room for one more record in the current buffer: a full one goes to the writer (waiting while the previous is
   still being written), the next begins after it, in a new segment where this one is full.  The wait releases
   the lock, and another thread (a put, compaction) may hand the buffer over meanwhile: what to do is decided
   again after each wait. */
static int reserve_record_locked(store_t *s) {
    for (;;) {
        if (s->error) return s->error;
        if (s->cur.used + s->rec <= s->buffer_bytes) return 0;
        if (s->stop) return -ECANCELED; /* closing: the writer is gone */
        if (s->pend_full) {
            pthread_cond_wait(&s->writer_done, &s->mu);
            continue;
        }
        int64_t segment = s->cur.segment, base = s->cur.base + s->buffer_bytes;
        if (base + s->buffer_bytes > s->segment_bytes) {
            int rc = segment_create_locked(s, &segment);
            if (rc) return rc;
            base = 0;
        }
        uint8_t *free_data = s->pend.data;
        s->pend = s->cur;
        s->pend_full = 1;
        pthread_cond_signal(&s->writer_wake);
        s->cur.data = free_data;
        memset(free_data, 0, (size_t)s->buffer_bytes);
        s->cur.segment = segment;
        s->cur.base = base;
        s->cur.used = 0;
        s->segments[segment]->end = base + s->buffer_bytes;
        return 0;
    }
}

/* Appends one record (id then its bytes) to the current buffer and points the index at it. */
static int append_locked(store_t *s, int64_t id, const uint8_t *record) {
    int rc = reserve_record_locked(s);
    if (rc) return rc;
    rc = index_reserve(&s->index);
    if (rc) return fail_path(s, rc, s->folder);
    uint8_t *place = s->cur.data + s->cur.used;
    memcpy(place, &id, sizeof(int64_t));
    memcpy(place + sizeof(int64_t), record, (size_t)s->record_bytes);
    uint64_t old = index_set(&s->index, id, pack(s->cur.segment, s->cur.base + s->cur.used));
    if (old != EMPTY) {
        segment_t *previous = segment_at(s, loc_segment(old));
        if (previous) previous->live -= s->rec;
        s->live_total -= s->rec;
    }
    s->segments[s->cur.segment]->live += s->rec;
    s->live_total += s->rec;
    s->cur.used += s->rec;
    return 0;
}

static void *writer_main(void *argument) {
    store_t *s = argument;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && (!s->pend_full || s->error)) pthread_cond_wait(&s->writer_wake, &s->mu);
        if (s->stop) break;
        segment_t *segment = s->segments[s->pend.segment];
        int fd = segment->fd;
        const uint8_t *data = s->pend.data;
        int64_t offset = s->pend.base;
        pthread_mutex_unlock(&s->mu);
        int rc = write_all(fd, data, s->buffer_bytes, offset);
        pthread_mutex_lock(&s->mu);
        if (rc) {
            /* the buffer stays in memory (its records are still read from it); every later write fails */
            s->error = fail_segment(s, rc, s->pend.segment);
        } else {
            int64_t end = offset + s->buffer_bytes;
            if (end > segment->extent) {
                s->stats[STAT_DISK_BYTES] += end - segment->extent;
                segment->extent = end;
            }
            segment->full_end = end;
            segment->dirty = 1;
            if (end + s->buffer_bytes > s->segment_bytes) segment->sealed = 1;
            s->pend_full = 0;
            wake_compactor_locked(s);
        }
        pthread_cond_broadcast(&s->writer_done);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- reads ---- */

static int read_item(store_t *s, const read_item_t *item, uint8_t *buffer) {
    int64_t offset = loc_offset(item->loc);
    int64_t start = offset & ~(int64_t)(ALIGN - 1);
    int64_t bytes = round_up(offset + s->rec, ALIGN) - start;
    int rc = read_all(item->fd, buffer, bytes, start);
    if (rc) return rc;
    int64_t id;
    memcpy(&id, buffer + (offset - start), sizeof(int64_t));
    if (id != item->id) return -EIO; /* not the record the index points at: the file is damaged */
    memcpy(item->out, buffer + (offset - start) + sizeof(int64_t), (size_t)s->record_bytes);
    return 0;
}

/* Reads the pool's items, taking them one at a time, until none is left; notes the first error. */
static void pool_work(pool_t *pool, uint8_t *buffer) {
    for (;;) {
        int64_t i = __atomic_fetch_add(&pool->next, 1, __ATOMIC_RELAXED);
        if (i >= pool->n) return;
        if (__atomic_load_n(&pool->error, __ATOMIC_RELAXED)) continue;
        int rc = read_item(pool->store, &pool->items[i], buffer);
        if (rc) {
            pthread_mutex_lock(&pool->mu);
            if (!pool->error) {
                pool->error = rc;
                pool->error_segment = pool->items[i].segment;
            }
            pthread_mutex_unlock(&pool->mu);
        }
    }
}

typedef struct {
    pool_t *pool;
    int number;
} pool_thread_t;

static void *pool_main(void *argument) {
    pool_thread_t *self = argument;
    pool_t *pool = self->pool;
    int number = self->number;
    free(self);
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (!pool->stop && pool->generation == seen) pthread_cond_wait(&pool->start, &pool->mu);
        if (pool->stop) break;
        seen = pool->generation;
        pthread_mutex_unlock(&pool->mu);
        pool_work(pool, pool->buffers[number]);
        pthread_mutex_lock(&pool->mu);
        if (--pool->active == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

static int pool_start(pool_t *pool, store_t *s, int threads) {
    pool->store = s;
    pool->count = threads - 1;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_mutex_init(&pool->call, NULL);
    pthread_cond_init(&pool->start, NULL);
    pthread_cond_init(&pool->done, NULL);
    int64_t buffer_bytes = round_up(s->rec, ALIGN) + ALIGN;
    pthread_cond_init(&pool->queue_free, NULL);
    if (s->direct && s->asynchronous) {
        /* a get's thread keeps QUEUE_DEPTH reads in flight; where the kernel refuses it, the threads read */
        pool->queue_buffer_bytes = buffer_bytes;
        pool->queue_buffers = aligned(buffer_bytes * QUEUE_DEPTH * QUEUES);
        if (!pool->queue_buffers) return -ENOMEM;
        int made = 0;
        while (made < QUEUES && syscall(SYS_io_setup, QUEUE_DEPTH, &pool->queues[made]) == 0) made++;
        if (made == QUEUES) {
            pool->aio = 1;
            pool->count = 0;
        } else {
            while (made > 0) syscall(SYS_io_destroy, pool->queues[--made]);
        }
    }
    pool->buffers = calloc((size_t)pool->count + 1, sizeof(uint8_t *));
    pool->threads = calloc((size_t)pool->count + 1, sizeof(pthread_t));
    if (!pool->buffers || !pool->threads) return -ENOMEM;
    for (int i = 0; i <= pool->count; i++)
        if (!(pool->buffers[i] = aligned(buffer_bytes))) return -ENOMEM;
    for (int i = 0; i < pool->count; i++) {
        pool_thread_t *self = malloc(sizeof(pool_thread_t));
        if (!self) return -ENOMEM;
        self->pool = pool;
        self->number = i;
        int rc = pthread_create(&pool->threads[i], NULL, pool_main, self);
        if (rc) {
            free(self);
            return -rc;
        }
        pool->started++;
    }
    return 0;
}

static void pool_stop(pool_t *pool) {
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->started; i++) pthread_join(pool->threads[i], NULL);
    for (int i = 0; pool->aio && i < QUEUES; i++) syscall(SYS_io_destroy, pool->queues[i]);
    free(pool->queue_buffers);
    if (pool->buffers)
        for (int i = 0; i <= pool->count; i++) free(pool->buffers[i]);
    free(pool->buffers);
    free(pool->threads);
}

/* Reads items on the kernel's asynchronous I/O, QUEUE_DEPTH in flight; returns the first error (its segment in
   *segment).  Every read submitted is reaped before it returns, even after an error. */
static int queue_read(pool_t *pool, int queue, read_item_t *items, int64_t n, int64_t *segment) {
    store_t *s = pool->store;
    aio_context_t context = pool->queues[queue];
    uint8_t *buffers = pool->queue_buffers + (int64_t)queue * QUEUE_DEPTH * pool->queue_buffer_bytes;
    struct iocb blocks[QUEUE_DEPTH];
    struct iocb *ready[QUEUE_DEPTH];
    struct io_event events[QUEUE_DEPTH];
    int64_t item_of[QUEUE_DEPTH];
    int free_slots[QUEUE_DEPTH];
    int free_count = QUEUE_DEPTH, in_flight = 0, rc = 0;
    for (int i = 0; i < QUEUE_DEPTH; i++) free_slots[i] = i;
    int64_t next = 0;
    while (in_flight > 0 || (next < n && !rc)) {
        int prepared = 0;
        while (!rc && next < n && free_count > 0) {
            int slot = free_slots[--free_count];
            const read_item_t *item = &items[next];
            int64_t offset = loc_offset(item->loc);
            int64_t start = offset & ~(int64_t)(ALIGN - 1);
            struct iocb *block = &blocks[slot];
            memset(block, 0, sizeof(*block));
            block->aio_fildes = (uint32_t)item->fd;
            block->aio_lio_opcode = IOCB_CMD_PREAD;
            block->aio_buf = (uint64_t)(uintptr_t)(buffers + slot * pool->queue_buffer_bytes);
            block->aio_nbytes = (uint64_t)(round_up(offset + s->rec, ALIGN) - start);
            block->aio_offset = start;
            block->aio_data = (uint64_t)slot;
            item_of[slot] = next++;
            ready[prepared++] = block;
        }
        int submitted = 0;
        while (submitted < prepared) {
            long done = syscall(SYS_io_submit, context, (long)(prepared - submitted), ready + submitted);
            if (done < 0 && errno == EINTR) continue;
            if (done <= 0) { /* the rest were never submitted: give their slots back */
                if (!rc) {
                    rc = done < 0 ? -errno : -EIO;
                    *segment = items[item_of[ready[submitted]->aio_data]].segment;
                }
                for (int i = submitted; i < prepared; i++) free_slots[free_count++] = (int)ready[i]->aio_data;
                break;
            }
            submitted += (int)done;
            in_flight += (int)done;
        }
        if (in_flight == 0) continue;
        long reaped = syscall(SYS_io_getevents, context, 1L, (long)QUEUE_DEPTH, events, NULL);
        if (reaped < 0) {
            if (errno == EINTR) continue;
            abort(); /* EFAULT, EINVAL: a bug; returning would leave reads in flight writing into our buffers */
        }
        for (long e = 0; e < reaped; e++) {
            int slot = (int)events[e].data;
            const read_item_t *item = &items[item_of[slot]];
            struct iocb *block = &blocks[slot];
            in_flight--;
            free_slots[free_count++] = slot;
            if (rc) continue;
            int64_t got = events[e].res;
            int64_t offset = loc_offset(item->loc);
            const uint8_t *data = (const uint8_t *)(uintptr_t)block->aio_buf + (offset - block->aio_offset);
            int64_t id;
            if (got < 0) {
                rc = (int)got;
            } else if (got < (int64_t)block->aio_nbytes) {
                rc = -EIO;
            } else {
                memcpy(&id, data, sizeof(int64_t));
                if (id != item->id) rc = -EIO; /* not the record the index points at: the file is damaged */
                else memcpy(item->out, data + sizeof(int64_t), (size_t)s->record_bytes);
            }
            if (rc) *segment = item->segment;
        }
    }
    return rc;
}

/* Reads items (sorted) on the kernel's asynchronous I/O, else on the pool and the calling thread; returns the
   first error (its segment in *segment). */
static int pool_read(pool_t *pool, read_item_t *items, int64_t n, int64_t *segment) {
    if (pool->aio) {
        pthread_mutex_lock(&pool->mu);
        int queue = 0;
        for (;;) {
            while (queue < QUEUES && pool->queue_busy[queue]) queue++;
            if (queue < QUEUES) break;
            pthread_cond_wait(&pool->queue_free, &pool->mu);
            queue = 0;
        }
        pool->queue_busy[queue] = 1;
        pthread_mutex_unlock(&pool->mu);
        int rc = queue_read(pool, queue, items, n, segment);
        pthread_mutex_lock(&pool->mu);
        pool->queue_busy[queue] = 0;
        pthread_cond_signal(&pool->queue_free);
        pthread_mutex_unlock(&pool->mu);
        return rc;
    }
    pthread_mutex_lock(&pool->call);
    pool->items = items;
    pool->n = n;
    pool->next = 0;
    pool->error = 0;
    int helpers = (int)(n - 1 < pool->count ? n - 1 : pool->count);
    if (helpers > 0) {
        pthread_mutex_lock(&pool->mu);
        pool->active = pool->count;
        pool->generation++;
        pthread_cond_broadcast(&pool->start);
        pthread_mutex_unlock(&pool->mu);
    }
    pool_work(pool, pool->buffers[pool->count]);
    pthread_mutex_lock(&pool->mu);
    if (helpers > 0)
        while (pool->active > 0) pthread_cond_wait(&pool->done, &pool->mu);
    int rc = pool->error;
    *segment = pool->error_segment;
    pthread_mutex_unlock(&pool->mu);
    pthread_mutex_unlock(&pool->call);
    return rc;
}

static int by_location(const void *a, const void *b) {
    uint64_t x = ((const read_item_t *)a)->loc, y = ((const read_item_t *)b)->loc;
    return x < y ? -1 : x > y;
}

/* ---- compaction ---- */

/* One sealed segment's current records appended again and its file deleted.  Returns 1 when one was compacted,
   0 when none is due (or a scan is open), < 0 on an error. */
static int compact_once(store_t *s) {
    pthread_mutex_lock(&s->mu);
    if (s->error) {
        int rc = s->error;
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    int64_t victim = -1;
    if (!s->stop && !s->scans && compaction_due_locked(s)) {
        for (int64_t i = 0; i < s->segment_count; i++) {
            segment_t *segment = s->segments[i];
            if (segment && segment->sealed && (victim < 0 || segment->live < s->segments[victim]->live))
                victim = i;
        }
        if (victim >= 0 && 2 * s->segments[victim]->live > s->segment_bytes) victim = -1;
    }
    if (victim < 0) {
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    s->compacting = 1;
    segment_t *segment = s->segments[victim];
    int fd = segment->fd;
    int64_t extent = segment->extent;
    int rc = 0;
    for (int64_t base = 0; base < extent && segment->live > 0 && !rc; base += s->buffer_bytes) {
        pthread_mutex_unlock(&s->mu);
        rc = read_all(fd, s->compact_chunk, s->buffer_bytes, base);
        pthread_mutex_lock(&s->mu);
        if (rc) {
            rc = fail_segment(s, rc, victim);
            break;
        }
        for (int64_t k = 0; k < s->per_buffer && !rc; k++) {
            const uint8_t *place = s->compact_chunk + k * s->rec;
            int64_t id;
            memcpy(&id, place, sizeof(int64_t));
            uint64_t here = pack(victim, base + k * s->rec);
            if (index_find(&s->index, id) != here) continue;
            rc = reserve_record_locked(s); /* may wait for the writer, the lock released: look again after */
            if (!rc && index_find(&s->index, id) == here) rc = append_locked(s, id, place + sizeof(int64_t));
        }
    }
    if (!rc && segment->live != 0) rc = fail_segment(s, -EIO, victim); /* a record the index points at was missed */
    if (rc) {
        s->compacting = 0;
        pthread_cond_broadcast(&s->scans_done);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    pthread_mutex_unlock(&s->mu);
    pthread_rwlock_wrlock(&s->files); /* no reader holds a location in it any more */
    pthread_mutex_lock(&s->mu);
    s->segments[victim] = NULL;
    s->stats[STAT_DISK_BYTES] -= segment->extent;
    s->stats[STAT_SEGMENTS]--;
    s->stats[STAT_COMPACTIONS]++;
    s->compacting = 0;
    pthread_cond_broadcast(&s->scans_done);
    pthread_mutex_unlock(&s->mu);
    close(segment->fd);
    char path[PATH_BYTES];
    segment_path(s, victim, path);
    rc = unlink(path) ? fail_path(s, -errno, path) : 1;
    pthread_rwlock_unlock(&s->files);
    free(segment);
    return rc;
}

static int compact_while_due(store_t *s) {
    pthread_mutex_lock(&s->compact_mu);
    int rc;
    while ((rc = compact_once(s)) > 0) {
    }
    pthread_mutex_unlock(&s->compact_mu);
    return rc;
}

static void *compactor_main(void *argument) {
    store_t *s = argument;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && !s->compact_wanted) pthread_cond_wait(&s->compact_wake, &s->mu);
        if (s->stop) break;
        s->compact_wanted = 0;
        pthread_mutex_unlock(&s->mu);
        compact_while_due(s); /* an error is sticky where it matters (a write); the next call reports it */
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- the API ---- */

static void store_free(store_t *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->writer_wake);
    pthread_cond_broadcast(&s->writer_done);
    pthread_cond_broadcast(&s->compact_wake);
    pthread_mutex_unlock(&s->mu);
    if (s->writer_started) pthread_join(s->writer, NULL);
    if (s->compactor_started) pthread_join(s->compactor, NULL);
    pool_stop(&s->pool);
    for (int64_t i = 0; i < s->segment_count; i++)
        if (s->segments[i]) {
            close(s->segments[i]->fd);
            free(s->segments[i]);
        }
    free(s->segments);
    free(s->index.slots);
    free(s->cur.data);
    free(s->pend.data);
    free(s->compact_chunk);
    free(s);
}

/* Opens a store in folder (which exists and holds no segment files).  buffer_bytes: a multiple of 4096 holding
   at least one record; segment_bytes: a multiple of buffer_bytes.  Returns 0 and *out, or -errno with the path
   concerned in error (error_bytes long). */
int paramserver_row_log_open(const char *folder, int64_t record_bytes, int64_t buffer_bytes, int64_t segment_bytes,
                             int direct, int read_threads, int asynchronous, void **out, char *error,
                             int64_t error_bytes) {
    *out = NULL;
    if (record_bytes <= 0 || buffer_bytes <= 0 || buffer_bytes % ALIGN || buffer_bytes < record_bytes + 8 ||
        segment_bytes < buffer_bytes || segment_bytes % buffer_bytes ||
        segment_bytes > (1LL << OFFSET_BITS) || read_threads < 1 || strlen(folder) >= FOLDER_BYTES) {
        snprintf(error, (size_t)error_bytes, "%s", folder);
        return -EINVAL;
    }
    store_t *s = calloc(1, sizeof(store_t));
    if (!s) return -ENOMEM;
    snprintf(s->folder, FOLDER_BYTES, "%s", folder);
    s->record_bytes = record_bytes;
    s->rec = record_bytes + (int64_t)sizeof(int64_t);
    s->buffer_bytes = buffer_bytes;
    s->segment_bytes = segment_bytes;
    s->per_buffer = buffer_bytes / s->rec;
    s->direct = direct ? 1 : 0;
    s->asynchronous = asynchronous ? 1 : 0;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->error_mu, NULL);
    pthread_mutex_init(&s->compact_mu, NULL);
    pthread_rwlock_init(&s->files, NULL);
    pthread_cond_init(&s->writer_wake, NULL);
    pthread_cond_init(&s->writer_done, NULL);
    pthread_cond_init(&s->compact_wake, NULL);
    pthread_cond_init(&s->scans_done, NULL);
    int rc = index_init(&s->index, 1024);
    s->segment_capacity = 16;
    s->segments = calloc((size_t)s->segment_capacity, sizeof(segment_t *));
    s->cur.data = aligned(buffer_bytes);
    s->pend.data = aligned(buffer_bytes);
    s->compact_chunk = aligned(buffer_bytes);
    if (!rc && (!s->segments || !s->cur.data || !s->pend.data || !s->compact_chunk)) rc = -ENOMEM;
    if (rc) fail_path(s, rc, folder);
    int64_t first;
    if (!rc) rc = segment_create_locked(s, &first); /* says whether the filesystem takes O_DIRECT */
    if (!rc && (rc = pool_start(&s->pool, s, read_threads))) fail_path(s, rc, folder);
    if (!rc) {
        s->cur.segment = first;
        s->segments[first]->end = buffer_bytes;
        s->stats[STAT_DIRECT] = s->direct;
        s->stats[STAT_ASYNCHRONOUS] = s->pool.aio != 0;
        rc = -pthread_create(&s->writer, NULL, writer_main, s);
        s->writer_started = !rc;
        if (rc) fail_path(s, rc, folder);
    }
    if (!rc) {
        rc = -pthread_create(&s->compactor, NULL, compactor_main, s);
        s->compactor_started = !rc;
        if (rc) fail_path(s, rc, folder);
    }
    if (rc) {
        snprintf(error, (size_t)error_bytes, "%s", s->error_path[0] ? s->error_path : folder);
        char path[PATH_BYTES];
        for (int64_t i = 0; i < s->segment_count; i++) {
            segment_path(s, i, path);
            unlink(path);
        }
        store_free(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* The path the last error concerned, into path (bytes long). */
void paramserver_row_log_error_path(void *handle, char *path, int64_t bytes) {
    store_t *s = handle;
    pthread_mutex_lock(&s->error_mu);
    snprintf(path, (size_t)bytes, "%s", s->error_path);
    pthread_mutex_unlock(&s->error_mu);
}

int paramserver_row_log_put(void *handle, const int64_t *ids, const uint8_t *records, int64_t n) {
    store_t *s = handle;
    int rc = 0;
    pthread_mutex_lock(&s->mu);
    for (int64_t i = 0; i < n && !rc; i++) {
        rc = append_locked(s, ids[i], records + i * s->record_bytes);
        if (!rc) s->stats[STAT_WRITES]++;
    }
    s->stats[STAT_WRITTEN_BYTES] = s->stats[STAT_WRITES] * s->record_bytes;
    if (s->error && !rc) rc = s->error;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* found[i] = 1 where ids[i] is held (its record copied into out's row i), else 0. */
int paramserver_row_log_get(void *handle, const int64_t *ids, int64_t n, uint8_t *out, uint8_t *found) {
    store_t *s = handle;
    read_item_t *items = malloc((size_t)(n > 0 ? n : 1) * sizeof(read_item_t));
    if (!items) return fail_path(s, -ENOMEM, s->folder);
    int64_t m = 0, hits = 0;
    pthread_rwlock_rdlock(&s->files);
    pthread_mutex_lock(&s->mu);
    for (int64_t i = 0; i < n; i++) {
        uint64_t loc = index_find(&s->index, ids[i]);
        found[i] = loc != EMPTY;
        if (loc == EMPTY) continue;
        hits++;
        uint8_t *row = out + i * s->record_bytes;
        const uint8_t *memory = in_memory(s, loc_segment(loc), loc_offset(loc));
        if (memory) {
            memcpy(row, memory + sizeof(int64_t), (size_t)s->record_bytes);
            continue;
        }
        read_item_t *item = &items[m++];
        item->segment = loc_segment(loc);
        item->fd = s->segments[item->segment]->fd;
        item->loc = loc;
        item->out = row;
        item->id = ids[i];
    }
    s->stats[STAT_READS] += hits;
    s->stats[STAT_READ_BYTES] += hits * s->record_bytes;
    pthread_mutex_unlock(&s->mu);
    int rc = 0;
    if (m > 0) {
        qsort(items, (size_t)m, sizeof(read_item_t), by_location);
        int64_t segment = 0;
        rc = pool_read(&s->pool, items, m, &segment);
        if (rc) fail_segment(s, rc, segment);
    }
    pthread_rwlock_unlock(&s->files);
    free(items);
    return rc;
}

int paramserver_row_log_delete(void *handle, const int64_t *ids, int64_t n) {
    store_t *s = handle;
    pthread_mutex_lock(&s->mu);
    int rc = s->error;
    for (int64_t i = 0; i < n && !rc; i++) {
        uint64_t old = index_erase(&s->index, ids[i]);
        if (old == EMPTY) continue;
        segment_t *segment = segment_at(s, loc_segment(old));
        if (segment) segment->live -= s->rec;
        s->live_total -= s->rec;
    }
    if (!rc) wake_compactor_locked(s);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Every record put is written (the current buffer padded to the alignment) and every file written fsynced. */
int paramserver_row_log_flush(void *handle) {
    store_t *s = handle;
    pthread_rwlock_rdlock(&s->files);
    pthread_mutex_lock(&s->mu);
    while (s->pend_full && !s->error && !s->stop) pthread_cond_wait(&s->writer_done, &s->mu);
    int rc = s->error ? s->error : s->stop ? -ECANCELED : 0;
    if (!rc && s->cur.used > 0) {
        segment_t *segment = s->segments[s->cur.segment];
        int64_t bytes = round_up(s->cur.used, ALIGN);
        rc = write_all(segment->fd, s->cur.data, bytes, s->cur.base);
        if (rc) {
            rc = s->error = fail_segment(s, rc, s->cur.segment);
        } else if (s->cur.base + bytes > segment->extent) {
            s->stats[STAT_DISK_BYTES] += s->cur.base + bytes - segment->extent;
            segment->extent = s->cur.base + bytes;
        }
        segment->dirty = 1;
    }
    int64_t count = 0;
    int *fds = rc ? NULL : malloc((size_t)s->segment_count * sizeof(int) + 1);
    int64_t *which = rc ? NULL : malloc((size_t)s->segment_count * sizeof(int64_t) + 1);
    if (!rc && (!fds || !which)) rc = fail_path(s, -ENOMEM, s->folder);
    for (int64_t i = 0; i < s->segment_count && !rc; i++)
        if (s->segments[i] && s->segments[i]->dirty) {
            s->segments[i]->dirty = 0;
            which[count] = i;
            fds[count++] = s->segments[i]->fd;
        }
    pthread_mutex_unlock(&s->mu);
    for (int64_t i = 0; i < count && !rc; i++)
        if (fsync(fds[i])) {
            rc = fail_segment(s, -errno, which[i]);
            pthread_mutex_lock(&s->mu);
            s->error = rc;
            pthread_mutex_unlock(&s->mu);
        }
    pthread_rwlock_unlock(&s->files);
    free(fds);
    free(which);
    return rc;
}

/* Compacts now, while compaction is due; returns 0 or -errno. */
int paramserver_row_log_compact(void *handle) { return compact_while_due(handle); }

/* STAT_COUNT counters into out. */
void paramserver_row_log_stats(void *handle, int64_t *out) {
    store_t *s = handle;
    pthread_mutex_lock(&s->mu);
    memcpy(out, s->stats, sizeof(s->stats));
    out[STAT_ROWS] = s->index.count;
    out[STAT_LIVE_BYTES] = s->live_total;
    out[STAT_INDEX_MEMORY] = (int64_t)(s->index.mask + 1) * (int64_t)sizeof(slot_t);
    /* the write buffers, compaction's chunk, the reads' buffers (a scan's chunk is its own, while it is open) */
    out[STAT_BUFFER_MEMORY] = 3 * s->buffer_bytes + (s->pool.count + 1 + (s->pool.aio ? QUEUE_DEPTH * QUEUES : 0)) *
                              (round_up(s->rec, ALIGN) + ALIGN);
    pthread_mutex_unlock(&s->mu);
}

int paramserver_row_log_stat_count(void) { return STAT_COUNT; }

typedef struct {
    int64_t segment, offset;
    uint8_t *chunk;
    int64_t chunk_segment, chunk_base, chunk_bytes; /* chunk_bytes 0: nothing read */
} cursor_t;

/* A scan's cursor (compaction waits until it is closed). */
int paramserver_row_log_scan_open(void *handle, void **out) {
    store_t *s = handle;
    cursor_t *cursor = calloc(1, sizeof(cursor_t));
    if (cursor) cursor->chunk = aligned(s->buffer_bytes);
    if (!cursor || !cursor->chunk) {
        free(cursor);
        return fail_path(s, -ENOMEM, s->folder);
    }
    pthread_mutex_lock(&s->mu);
    while (s->compacting) pthread_cond_wait(&s->scans_done, &s->mu);
    s->scans++;
    pthread_mutex_unlock(&s->mu);
    *out = cursor;
    return 0;
}

/* Up to most current records (ids, records) from the cursor on; returns how many (0: the end) or -errno. */
int64_t paramserver_row_log_scan_next(void *handle, void *opened, int64_t most, int64_t *ids, uint8_t *records) {
    store_t *s = handle;
    cursor_t *cursor = opened;
    int64_t n = 0;
    pthread_mutex_lock(&s->mu);
    while (n < most && cursor->segment < s->segment_count) {
        segment_t *segment = s->segments[cursor->segment];
        int64_t in_buffer = cursor->offset % s->buffer_bytes;
        if (!segment || cursor->offset >= segment->end) {
            cursor->segment++;
            cursor->offset = 0;
            continue;
        }
        if (in_buffer / s->rec >= s->per_buffer) { /* the padding at a buffer's end */
            cursor->offset += s->buffer_bytes - in_buffer;
            continue;
        }
        if (cursor->segment == s->cur.segment && cursor->offset >= s->cur.base + s->cur.used) {
            cursor->segment++; /* the current buffer's unused part: nothing after it */
            cursor->offset = 0;
            continue;
        }
        const uint8_t *place = in_memory(s, cursor->segment, cursor->offset);
        if (!place) {
            int covered = cursor->chunk_bytes && cursor->chunk_segment == cursor->segment &&
                          cursor->offset >= cursor->chunk_base &&
                          cursor->offset + s->rec <= cursor->chunk_base + cursor->chunk_bytes;
            if (!covered) {
                int64_t base = cursor->offset & ~(int64_t)(ALIGN - 1);
                int64_t bytes = segment->full_end - base < s->buffer_bytes ? segment->full_end - base : s->buffer_bytes;
                int fd = segment->fd;
                if (bytes < round_up(cursor->offset - base + s->rec, ALIGN)) {
                    n = fail_segment(s, -EIO, cursor->segment); /* a record neither in memory nor written */
                    break;
                }
                pthread_mutex_unlock(&s->mu);
                int rc = read_all(fd, cursor->chunk, bytes, base);
                pthread_mutex_lock(&s->mu);
                if (rc) {
                    n = fail_segment(s, rc, cursor->segment);
                    break;
                }
                cursor->chunk_segment = cursor->segment;
                cursor->chunk_base = base;
                cursor->chunk_bytes = bytes;
                continue; /* look again: the buffers may have moved on meanwhile */
            }
            place = cursor->chunk + (cursor->offset - cursor->chunk_base);
        }
        int64_t id;
        memcpy(&id, place, sizeof(int64_t));
        if (index_find(&s->index, id) == pack(cursor->segment, cursor->offset)) {
            ids[n] = id;
            memcpy(records + n * s->record_bytes, place + sizeof(int64_t), (size_t)s->record_bytes);
            n++;
        }
        cursor->offset += s->rec;
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

void paramserver_row_log_scan_close(void *handle, void *opened) {
    store_t *s = handle;
    cursor_t *cursor = opened;
    pthread_mutex_lock(&s->mu);
    s->scans--;
    if (!s->scans && compaction_due_locked(s)) wake_compactor_locked(s);
    pthread_mutex_unlock(&s->mu);
    free(cursor->chunk);
    free(cursor);
}

/* Stops the threads and closes the files (records still in memory are not written: the store is never
   reopened); remove deletes the segment files and the folder.  Returns 0 or -errno (the path concerned
   into error). */
int paramserver_row_log_close(void *handle, int remove, char *error, int64_t error_bytes) {
    store_t *s = handle;
    char folder[FOLDER_BYTES];
    snprintf(folder, FOLDER_BYTES, "%s", s->folder);
    int64_t segments = s->segment_count;
    store_free(s);
    if (!remove) return 0;
    char path[PATH_BYTES];
    for (int64_t i = 0; i < segments; i++) {
        snprintf(path, PATH_BYTES, "%s/segment-%08lld.log", folder, (long long)i);
        if (unlink(path) && errno != ENOENT) {
            int rc = -errno;
            snprintf(error, (size_t)error_bytes, "%s", path);
            return rc;
        }
    }
    if (rmdir(folder)) {
        int rc = -errno;
        snprintf(error, (size_t)error_bytes, "%s", folder);
        return rc;
    }
    return 0;
}
