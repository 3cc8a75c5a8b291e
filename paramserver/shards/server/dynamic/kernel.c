/* The dynamic tables' lookup kernel: finds a batch of ids in an IdIndex's buckets, touches them and copies their
   rows (paramserver_find).  Loaded with ctypes by native.py, which also says how it is built: at install time by
   setup.py (a baseline build and an AVX2 build), else at first use with the system's compiler.  No Python.h: it is
   a plain shared library, whatever its file is named. */
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
/* How many ids ahead the memory an id needs is asked for (prefetched), so that the misses of consecutive ids
   overlap instead of following one another. */
#define AHEAD 16
/* Lanes per bucket: IdIndex.LANES (the caller checks).  A bucket is 2 * LANES int64 words: the lanes' keys,
   then their slots (int32), then their last touches (int32). */
#define LANES 8
#define BUCKET_WORDS (2 * LANES)

static inline uint64_t home_bucket(int64_t id, int bits) {
    return bits ? ((uint64_t)id * GOLDEN) >> (64 - bits) : 0;
}

/* Bit `lane` set where keys[lane] == id (match_mask) and where slots[lane] is empty, -1 (empty_mask): one
   bucket compared at once, in AVX2 or SSE2 vectors where the build has them, lane by lane otherwise. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    const __m256i wanted = _mm256_set1_epi64x(id);
    uint32_t mask = 0;
    for (int quad = 0; quad < LANES / 4; quad++) {
        __m256i equal = _mm256_cmpeq_epi64(_mm256_loadu_si256((const __m256i *)(keys + 4 * quad)), wanted);
        mask |= (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(equal)) << (4 * quad);
    }
    return mask;
}
#elif defined(__SSE2__)
#include <emmintrin.h>
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    const __m128i wanted = _mm_set1_epi64x(id);
    uint32_t mask = 0;
    for (int pair = 0; pair < LANES / 2; pair++) {
        /* SSE2 compares 32-bit halves: a key matches where both of its halves do */
        __m128i halves = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(keys + 2 * pair)), wanted);
        __m128i both = _mm_and_si128(halves, _mm_shuffle_epi32(halves, _MM_SHUFFLE(2, 3, 0, 1)));
        mask |= (uint32_t)_mm_movemask_pd(_mm_castsi128_pd(both)) << (2 * pair);
    }
    return mask;
}
#else
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    uint32_t mask = 0;
    for (int lane = 0; lane < LANES; lane++) mask |= (uint32_t)(keys[lane] == id) << lane;
    return mask;
}
#endif

static inline uint32_t empty_mask(const int32_t *slots) {
    uint32_t mask = 0;
    for (int lane = 0; lane < LANES; lane++) mask |= (uint32_t)(slots[lane] == -1) << lane;
    return mask;
}

/* A digest of this file, set by whoever builds it (-DPARAMSERVER_KERNEL_DIGEST="..."): native.py loads a build
   only if it names the source shipped beside it, so a build left from an older kernel.c is never used. */
#ifndef PARAMSERVER_KERNEL_DIGEST
#define PARAMSERVER_KERNEL_DIGEST ""
#endif
const char *paramserver_kernel_digest(void) { return PARAMSERVER_KERNEL_DIGEST; }

/* 1 where this processor runs AVX2 code (the kernel is then built again with it), 0 otherwise. */
int paramserver_cpu_has_avx2(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* For each of ids[0..n): its slot in the index (buckets of LANES lanes, see above; slots -1 empty, -2 removed),
   probing from its Fibonacci-hashed bucket through full buckets, at most max_run further; -1 where it is not
   held.  When step >= 0 the touch of every id found is set to step, in its bucket (the lines just read).  When
   rows_out is not NULL, the id's row (row_bytes of table) is copied to rows_out, zeros where it is not held.
   Two passes (find and touch, then copy), each asking for the memory of the id AHEAD places on.  Returns the
   number of ids found. */
int64_t paramserver_find(int64_t *index, int64_t buckets, int bits, int64_t max_run, const int64_t *ids, int64_t n,
                         int64_t *out, int32_t step, const char *table, int64_t row_bytes, char *rows_out) {
    const uint64_t mask = (uint64_t)buckets - 1;
    int64_t found_count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const int64_t *ahead = index + home_bucket(ids[i + AHEAD], bits) * BUCKET_WORDS;
            __builtin_prefetch(ahead, 1);
            __builtin_prefetch(ahead + 8, 1);
        }
        const int64_t id = ids[i];
        uint64_t bucket = home_bucket(id, bits);
        int64_t found = -1;
        for (int64_t run = 0; run <= max_run; run++) {
            int64_t *keys = index + bucket * BUCKET_WORDS;
            int32_t *slots = (int32_t *)(keys + LANES);
            /* an unused lane's key never matches an id looked for in its bucket: a match is the id */
            const uint32_t matches = match_mask(keys, id);
            if (matches) {
                const int lane = __builtin_ctz(matches);
                found = slots[lane];
                if (step >= 0) slots[LANES + lane] = step;
                break;
            }
            if (empty_mask(slots)) break;
            bucket = (bucket + 1) & mask;
        }
        out[i] = found;
        found_count += found >= 0;
    }
    if (!rows_out) return found_count;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && out[i + AHEAD] >= 0) __builtin_prefetch(table + out[i + AHEAD] * row_bytes);
        const int64_t found = out[i];
        if (found >= 0) memcpy(rows_out + i * row_bytes, table + found * row_bytes, (size_t)row_bytes);
        else memset(rows_out + i * row_bytes, 0, (size_t)row_bytes);
    }
    return found_count;
}
