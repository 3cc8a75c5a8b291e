/* The row-wise optimizers' native kernel: one pass per touched row.

   For each row of a push (distinct rows, duplicates summed by the caller) it reads the row and its state
   once, applies the optimizer's update in float32 and writes both back once.  Rows are float32, float16 or
   bfloat16; half rows are widened to float32, updated, and written back rounded to nearest or
   stochastically with the random bits of paramserver/optim/rounding.py (MurmurHash3's fmix32 chained over
   the stream's seed, the row id's two words and the column's Weyl word), so a row gets the same bits as
   the torch path gives it, however a push is split.  The arithmetic is the torch path's, in its order
   (the functional classes in row_kernel.py's docstring): a row's mean of squares (row-wise Adagrad) summed
   in double and rounded once, square roots correctly rounded, on both.

   Loaded with ctypes by paramserver/optim/row_kernel.py (through paramserver/native.py), which checks every
   argument: the kernel trusts them (it checks only that rows are rows of the table).  Compiled with
   -fno-trapping-math (its loops vectorise with their selects; no value changes) and -ffp-contract=off, so a
   product and a sum are fused
   (fmaf) only where the torch path fuses them; the AVX2 build also takes FMA and F16C instructions (-mfma
   -mf16c), which the processor must run too (paramserver_cpu_has_avx2), and converts and rounds half rows
   eight columns at a time (HALF_BLOCKS). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The AVX2 build (-mavx2 -mfma -mf16c) widens, rounds and narrows half rows eight columns at a time with AVX2's
   and F16C's instructions (HALF_BLOCKS below: F16C's conversions and a hand-scheduled stochastic rounding); the
   baseline build and the last columns of a row not a multiple of eight take the plain functions.  Both give
   the same bits. */
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HALF_BLOCKS 1
#endif

/* A digest of this file, set by whoever builds it (-DPARAMSERVER_KERNEL_DIGEST="..."): a build is loaded only
   if it names the source shipped beside it, so a build left from an older row_kernel.c is never used. */
#ifndef PARAMSERVER_KERNEL_DIGEST
#define PARAMSERVER_KERNEL_DIGEST ""
#endif
const char *paramserver_kernel_digest(void) { return PARAMSERVER_KERNEL_DIGEST; }

/* 1 where this processor runs AVX2, FMA and F16C code (the kernel is then built again with them: every
   processor with AVX2 has F16C), 0 otherwise. */
int paramserver_cpu_has_avx2(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") ? 1 : 0;
#else
    return 0;
#endif
}

enum { ROWS_FLOAT32 = 0, ROWS_FLOAT16 = 1, ROWS_BFLOAT16 = 2 };

/* A table's rows as the kernel writes them: data[row * dim + column] of type, count rows; half rows rounded to
   nearest, or stochastically in the stream seed (rounding.stream_seed), row r's id being ids[r] (ids not NULL)
   or first_row + r. */
typedef struct {
    void *data;
    int64_t dim;
    int64_t count;
    int32_t type;
    int32_t nearest;
    uint32_t seed;
    int32_t unused;
    int64_t first_row;
    const int64_t *ids;
} rows_t;

static inline uint32_t float_bits(float value) { uint32_t bits; memcpy(&bits, &value, 4); return bits; }
static inline float bits_float(uint32_t bits) { float value; memcpy(&value, &bits, 4); return value; }

static inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

/* Exact, without branches (so that loops of it vectorise): FP16's fp16_ieee_to_fp32_value. */
static inline float half_to_float(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_float((two_w >> 17) | (126u << 23)) - 0.5f;
    return bits_float(sign | (two_w < (1u << 27) ? float_bits(denormalized) : float_bits(normalized)));
}

/* To nearest, ties to even; overflow to infinity; NaN to a quiet NaN (as c10::Half converts). */
static inline uint16_t float_to_half(float value) {
    float base = (fabsf(value) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = float_bits(value), shl1 = w + w, sign = w & 0x80000000u, bias = shl1 & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_float((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = float_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xFF000000u ? 0x7E00u : nonsign));
}

static inline float bfloat16_to_float(uint16_t h) { return bits_float((uint32_t)h << 16); }

static inline uint16_t float_to_bfloat16(float value) {  /* to nearest, ties to even (as c10::BFloat16) */
    uint32_t bits = float_bits(value);
    return value != value ? 0x7FC0 : (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* The gap between the two values of float16 around value (rounding.round_stochastic's, read off the exponent's
   bits instead of nextafter: the same powers of two): |value| in [2**-14, 65504], float32's gap times 2**13. */
static inline float float16_gap(float value) {
    uint32_t exponent = float_bits(value) >> 23 & 0xFFu;
    exponent = exponent < 113 ? 113 : exponent > 142 ? 142 : exponent;
    return bits_float((exponent - 10) << 23);
}

/* bfloat16's: float32's gap times 2**16, subnormal below 2**-126 (|value| at most bfloat16's largest). */
static inline float bfloat16_gap(float value) {
    uint32_t exponent = float_bits(value) >> 23 & 0xFFu;
    exponent = exponent > 254 ? 254 : exponent < 1 ? 1 : exponent;
    return exponent >= 8 ? bits_float((exponent - 7) << 23) : bits_float(1u << (exponent + 15));
}

/* value rounded stochastically with the low 24 of bits onto the grid of gap (rounding.round_stochastic: NaN
   stays NaN, an infinity stays one).  Without branches, so that loops of it vectorise. */
static inline float round_on(float value, float gap, uint32_t bits) {
    float scaled = value / gap;
    float lower = floorf(scaled);
    float uniform = (float)(int32_t)(bits & 0xFFFFFFu) * 5.960464477539063e-08f;
    float down = floorf(uniform - (scaled - lower));
    down = down != down ? 0.0f : down;
    return (lower - down) * gap;
}

/* 0 where every one of rows[0..n) is a row of the table, else -2 (checked before anything is written). */
static int check_rows(const rows_t *table, const int64_t *rows, int64_t n) {
    int64_t outside = 0;
    for (int64_t i = 0; i < n; i++) outside |= (rows[i] < 0) | (rows[i] >= table->count);
    return outside ? -2 : 0;
}

/* 0 where rows[0..n) increase strictly (distinct, sorted: as a push sends a fixed table's rows) and are rows of
   a table of count rows; 1 where they do not increase; -2 where one is outside the table.  One pass, so a push
   is checked without the torch operations a check costs (each a dispatch, on caches the update just cooled). */
int paramserver_rows_increasing(const int64_t *rows, int64_t n, int64_t count) {
    if (n == 0) return 0;
    if (rows[0] < 0 || rows[n - 1] >= count) return -2;
    int64_t descents = 0;
    for (int64_t i = 1; i < n; i++) descents += rows[i] <= rows[i - 1];
    if (descents == 0) return 0;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= count) return -2;
    return 1;
}

/* How many rows ahead the kernel asks for the memory of the row it will update (the row and its state), so
   that the processor overlaps the misses of consecutive rows (a push's rows are scattered over the table). */
#define AHEAD 8

/* Ask for row rows[i + AHEAD]'s bytes of the table and of one state tensor (state_bytes a row, or none).
   Always inlined: a function that only prefetches has no effect GCC counts (its pure-const analysis), so a
   call of it that is not inlined before that analysis is deleted, prefetches and all. */
static inline __attribute__((always_inline)) void prefetch_ahead(const rows_t *table, const int64_t *rows, int64_t i, int64_t n,
                                  const void *state, int64_t state_bytes) {
    if (i + AHEAD >= n) return;
    int64_t r = rows[i + AHEAD];
    int64_t row_bytes = table->dim * (table->type == ROWS_FLOAT32 ? 4 : 2);
    const char *row = (const char *)table->data + r * row_bytes;
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset, 1);
    if (state) {
        const char *at = (const char *)state + r * state_bytes;
        for (int64_t offset = 0; offset < state_bytes; offset += 64) __builtin_prefetch(at + offset, 1);
    }
}

#ifdef HALF_BLOCKS
/* fmix32 of eight words. */
static inline __m256i fmix32_x8(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)0x85EBCA6Bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int32_t)0xC2B2AE35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* round_on of eight values, scaled being value / gap (value times gap's inverse: exact, a power of two). */
static inline __m256 round_on_x8(__m256 scaled, __m256 gap, __m256i bits) {
    __m256 lower = _mm256_floor_ps(scaled);
    __m256 uniform = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0xFFFFFF))),
                                   _mm256_set1_ps(5.960464477539063e-08f));
    __m256 down = _mm256_floor_ps(_mm256_sub_ps(uniform, _mm256_sub_ps(scaled, lower)));
    down = _mm256_and_ps(down, _mm256_cmp_ps(down, down, _CMP_ORD_Q));  /* NaN: +0 */
    return _mm256_mul_ps(_mm256_sub_ps(lower, down), gap);
}

/* Eight values rounded stochastically onto float16's grid (float16_gap, round_on) with bits. */
static inline __m256 round_float16_x8(__m256 value, __m256i bits) {
    __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(value), 23), _mm256_set1_epi32(0xFF));
    exponent = _mm256_min_epu32(_mm256_max_epu32(exponent, _mm256_set1_epi32(113)), _mm256_set1_epi32(142));
    __m256 gap = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(10)), 23));
    __m256 inverse = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(264), exponent), 23));
    return round_on_x8(_mm256_mul_ps(value, inverse), gap, bits);
}

/* bfloat16's (bfloat16_gap): below 2**-119 the gap's inverse is past float32's largest power of two, so the
   value is scaled by 2**64 first (exact: at most 2**-55 then) and by the rest of the inverse after. */
static inline __m256 round_bfloat16_x8(__m256 value, __m256i bits) {
    __m256i exponent = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(value), 23), _mm256_set1_epi32(0xFF));
    exponent = _mm256_min_epu32(_mm256_max_epu32(exponent, _mm256_set1_epi32(1)), _mm256_set1_epi32(254));
    __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), exponent);
    __m256i normal_gap = _mm256_slli_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(7)), 23);
    __m256i small_gap = _mm256_sllv_epi32(_mm256_set1_epi32(1), _mm256_add_epi32(exponent, _mm256_set1_epi32(15)));
    __m256 gap = _mm256_castsi256_ps(_mm256_blendv_epi8(normal_gap, small_gap, small));
    __m256i inverse = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_blendv_epi8(_mm256_set1_epi32(261),
                                                                             _mm256_set1_epi32(197), small), exponent), 23);
    __m256 first = _mm256_blendv_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(0x1.0p+64f), _mm256_castsi256_ps(small));
    __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(value, first), _mm256_castsi256_ps(inverse));
    return round_on_x8(scaled, gap, bits);
}

/* Where a row's values lie, seen eight at a time (range_x8): the largest and (less one, so that a zero is the
   largest of all) the smallest of their bits shifted past the sign (exponent bits on top, then the fraction's). */
typedef struct {
    __m256i largest, smallest;
} range_t;

static inline void range_x8(range_t *range, __m256i word) {
    __m256i magnitude = _mm256_slli_epi32(word, 1);
    range->largest = _mm256_max_epu32(range->largest, magnitude);
    range->smallest = _mm256_min_epu32(range->smallest, _mm256_add_epi32(magnitude, _mm256_set1_epi32(-1)));
}

/* 1 where every value seen is zero or of exponent bits low to high. */
static inline int range_within(range_t range, uint32_t low, uint32_t high) {
    __m256i top = _mm256_set1_epi32((int32_t)(((high + 1) << 24) - 1)), bottom = _mm256_set1_epi32((int32_t)((low << 24) - 1));
    __m256i fits = _mm256_and_si256(_mm256_cmpeq_epi32(_mm256_max_epu32(range.largest, top), top),
                                    _mm256_cmpeq_epi32(_mm256_min_epu32(range.smallest, bottom), bottom));
    return _mm256_movemask_epi8(fits) == -1;
}

/* round_on of eight values, on their bits, where their gap is the unit of their bits below (a mask of their last
   bits: the fraction, scaled - lower exactly) and fraction is those bits as 24 (the fraction in 2**-24): a
   value goes up in magnitude (by the unit, ~below + 1) where the draw (the low 24 random bits, mirrored for a
   negative value, whose scaled - lower is 1 less the fraction) is below the fraction; a zero (no bits below)
   stays as it is. */
static inline __m256 round_fraction_x8(__m256i word, __m256i bits, __m256i fraction, __m256i below) {
    __m256i draw = _mm256_and_si256(_mm256_xor_si256(bits, _mm256_srai_epi32(word, 31)), _mm256_set1_epi32(0xFFFFFF));
    __m256i down = _mm256_andnot_si256(below, _mm256_cmpgt_epi32(fraction, draw));  /* -unit where it goes up */
    return _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_andnot_si256(below, word), down));
}

/* round_float16_x8 on the bits (round_fraction_x8) for zeros and values of exponent bits 103 to 142 (float16's
   normal range from 113, 13 bits of fraction; below it the gap is 2**-24: 14 to 23 bits; a zero's shift is
   past 31, so that none of its bits is below). */
static inline __m256 round_float16_bits_x8(__m256 value, __m256i bits) {
    __m256i word = _mm256_castps_si256(value);
    __m256i exponent = _mm256_srli_epi32(_mm256_slli_epi32(word, 1), 24);
    __m256i shift = _mm256_min_epi32(_mm256_sub_epi32(exponent, _mm256_set1_epi32(94)), _mm256_set1_epi32(19));
    __m256i fraction = _mm256_srli_epi32(_mm256_sllv_epi32(word, shift), 8);
    return round_fraction_x8(word, bits, fraction, _mm256_srlv_epi32(_mm256_set1_epi32(-1), shift));
}

/* round_bfloat16_x8 on the bits for zeros and values of exponent bits 8 to 254 (16 bits of fraction). */
static inline __m256 round_bfloat16_bits_x8(__m256 value, __m256i bits) {
    __m256i word = _mm256_castps_si256(value);
    __m256i fraction = _mm256_and_si256(_mm256_slli_epi32(word, 8), _mm256_set1_epi32(0xFFFFFF));
    return round_fraction_x8(word, bits, fraction, _mm256_set1_epi32(0xFFFF));
}

/* Eight values written as float16 (float_to_half: F16C's conversion to nearest, NaN made its quiet NaN). */
static inline void store_float16_x8(uint16_t *out, __m256 value) {
    __m128i half = _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan), _mm256_extracti128_si256(nan, 1));
    __m128i quiet = _mm_or_si128(_mm_and_si128(half, _mm_set1_epi16((int16_t)0x8000)), _mm_set1_epi16(0x7E00));
    _mm_storeu_si128((__m128i *)out, _mm_blendv_epi8(half, quiet, nan16));
}

/* The high halves of eight words, in order. */
static inline __m128i pack_high_halves_x8(__m256i words) {
    __m256i high = _mm256_srli_epi32(words, 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8));
}

/* Eight values written as bfloat16 (float_to_bfloat16). */
static inline void store_bfloat16_x8(uint16_t *out, __m256 value) {
    __m256i bits = _mm256_castps_si256(value);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
    _mm_storeu_si128((__m128i *)out, pack_high_halves_x8(_mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan)));
}

#endif

/* Row row of the table as float32 values to update: the row itself for float32 rows (updated in place, no
   copy: measured 2.5x faster than through a scratch row), else the half row widened into scratch. */
static inline float *load_row(const rows_t *table, int64_t row, float *scratch) {
    int64_t dim = table->dim, c = 0;
    float *out = scratch;
    if (table->type == ROWS_FLOAT32) {
        return (float *)table->data + row * dim;
    } else if (table->type == ROWS_FLOAT16) {
        const uint16_t *in = (const uint16_t *)table->data + row * dim;
#ifdef HALF_BLOCKS
        for (; c + 8 <= dim; c += 8) _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + c))));
#endif
        for (; c < dim; c++) out[c] = half_to_float(in[c]);
    } else {
        const uint16_t *in = (const uint16_t *)table->data + row * dim;
        for (; c < dim; c++) out[c] = bfloat16_to_float(in[c]);
    }
    return out;
}

/* The word row row's columns' random bits derive from (rounding.rounding_bits). */
static inline uint32_t row_word(const rows_t *table, int64_t row) {
    int64_t id = table->ids ? table->ids[row] : table->first_row + row;
    uint32_t lo = (uint32_t)id, hi = (uint32_t)(id >> 32);
    return fmix32(lo ^ hi * 0x9E3779B9u ^ table->seed);
}

#ifdef HALF_BLOCKS
/* store_row's whole blocks of eight columns; returns how many columns it wrote.  Rounded stochastically, a row
   is rounded on the bits, and again the plain way (rare: a NaN, an infinity, a value past float16's largest or
   of float16's subnormals' tail) where one of its values was outside the binades that round so. */
static inline int64_t store_blocks(const rows_t *table, uint16_t *out, const float *values, uint32_t word) {
    int64_t dim = table->dim, whole = dim / 8 * 8;
    __m256i first = _mm256_mullo_epi32(_mm256_setr_epi32(1, 2, 3, 4, 5, 6, 7, 8), _mm256_set1_epi32((int32_t)0x9E3779B9u));
    __m256i step = _mm256_set1_epi32((int32_t)(8u * 0x9E3779B9u)), seed = _mm256_set1_epi32((int32_t)word), weyl = first;
    range_t range = {_mm256_setzero_si256(), _mm256_set1_epi32(-1)};
    if (table->type == ROWS_FLOAT16 && table->nearest) {
        for (int64_t c = 0; c < whole; c += 8) store_float16_x8(out + c, _mm256_loadu_ps(values + c));
    } else if (table->type == ROWS_FLOAT16) {
        for (int64_t c = 0; c < whole; c += 8, weyl = _mm256_add_epi32(weyl, step)) {
            __m256 value = _mm256_loadu_ps(values + c);
            range_x8(&range, _mm256_castps_si256(value));
            __m256 rounded = round_float16_bits_x8(value, fmix32_x8(_mm256_xor_si256(seed, weyl)));
            _mm_storeu_si128((__m128i *)(out + c), _mm256_cvtps_ph(rounded, _MM_FROUND_TO_NEAREST_INT));
        }
        if (!range_within(range, 103, 142))
            for (int64_t c = 0; c < whole; c += 8, first = _mm256_add_epi32(first, step))
                store_float16_x8(out + c, round_float16_x8(_mm256_loadu_ps(values + c), fmix32_x8(_mm256_xor_si256(seed, first))));
    } else if (table->nearest) {
        for (int64_t c = 0; c < whole; c += 8) store_bfloat16_x8(out + c, _mm256_loadu_ps(values + c));
    } else {
        for (int64_t c = 0; c < whole; c += 8, weyl = _mm256_add_epi32(weyl, step)) {
            __m256 value = _mm256_loadu_ps(values + c);
            range_x8(&range, _mm256_castps_si256(value));
            __m256 rounded = round_bfloat16_bits_x8(value, fmix32_x8(_mm256_xor_si256(seed, weyl)));
            _mm_storeu_si128((__m128i *)(out + c), pack_high_halves_x8(_mm256_castps_si256(rounded)));
        }
        if (!range_within(range, 8, 254))
            for (int64_t c = 0; c < whole; c += 8, first = _mm256_add_epi32(first, step))
                store_bfloat16_x8(out + c, round_bfloat16_x8(_mm256_loadu_ps(values + c), fmix32_x8(_mm256_xor_si256(seed, first))));
    }
    return whole;
}
#endif

/* values (load_row's, updated; used up) written to row row of the table, rounded as the table says (float32
   rows: written already, in place). */
static inline void store_row(const rows_t *table, int64_t row, float *values) {
    int64_t dim = table->dim, start = 0;
    if (table->type == ROWS_FLOAT32) return;
    uint16_t *out = (uint16_t *)table->data + row * dim;
    uint32_t word = table->nearest ? 0 : row_word(table, row);
#ifdef HALF_BLOCKS
    start = store_blocks(table, out, values, word);
#endif
    if (!table->nearest) {
        if (table->type == ROWS_FLOAT16)
            for (int64_t c = start; c < dim; c++)
                values[c] = round_on(values[c], float16_gap(values[c]), fmix32(word ^ (uint32_t)(c + 1) * 0x9E3779B9u));
        else
            for (int64_t c = start; c < dim; c++)
                values[c] = round_on(values[c], bfloat16_gap(values[c]), fmix32(word ^ (uint32_t)(c + 1) * 0x9E3779B9u));
    }
    if (table->type == ROWS_FLOAT16)
        for (int64_t c = start; c < dim; c++) out[c] = float_to_half(values[c]);
    else
        for (int64_t c = start; c < dim; c++) out[c] = float_to_bfloat16(values[c]);
}

/* Row-wise Adagrad (rowwise_adagrad.py) of rows[0..n) with their gradients (n x dim, float32) and their sums:
   g = grad + weight_decay * row; sum += mean(g * g) (in double, rounded once); row += (-lr * g) / (sqrt(sum) + eps).
   A row's step waits on its sum (a chain of dependent additions, a square root): each row's sum is taken
   before the previous row is updated and written, so that the processor works on both at once (rows are
   distinct: the same arithmetic per row, in any order of rows).
   0; -1 where no scratch memory could be had, -2 for a row outside the table (nothing written). */
int paramserver_rowwise_adagrad(const rows_t *table, const int64_t *rows, int64_t n, const float *grads,
                                float *sums, float lr, float eps, float weight_decay) {
    int64_t dim = table->dim;
    if (check_rows(table, rows, n)) return -2;
    float *scratch = malloc((size_t)(4 * dim + 8) * sizeof(float));  /* two rows and their decayed gradients */
    if (!scratch) return -1;
    float step = -lr;
    float *waiting = NULL, waiting_std = 0.0f;  /* the previous row, its gradient and its sum's root */
    const float *waiting_g = NULL;
    for (int64_t i = 0; i <= n; i++) {
        float *row = NULL, std = 0.0f;
        const float *g = NULL;
        if (i < n) {
            int64_t r = rows[i];
            prefetch_ahead(table, rows, i, n, sums, sizeof(float));
            row = load_row(table, r, scratch + (i & 1) * 2 * dim);
            g = grads + i * dim;  /* the gradient, with its weight decay where there is one */
            if (weight_decay != 0.0f) {
                float *decayed = scratch + (i & 1) * 2 * dim + dim;
                for (int64_t c = 0; c < dim; c++) decayed[c] = fmaf(row[c], weight_decay, g[c]);
                g = decayed;
            }
            /* the mean square in double (each square exact there) rounded once to float, as the torch path
               takes it: the same float whatever the order of the additions */
            double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int64_t c = 0;
            for (; c + 8 <= dim; c += 8)
                for (int lane = 0; lane < 8; lane++) lanes[lane] += (double)g[c + lane] * (double)g[c + lane];
            double total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            for (; c < dim; c++) total += (double)g[c] * (double)g[c];
            float sum = sums[r] + (float)(total / (double)dim);
            sums[r] = sum;
            std = sqrtf(sum) + eps;
        }
        if (waiting) {
            for (int64_t c = 0; c < dim; c++) waiting[c] = waiting[c] + step * waiting_g[c] / waiting_std;
            store_row(table, rows[i - 1], waiting);
        }
        waiting = row, waiting_g = g, waiting_std = std;
    }
    free(scratch);
    return 0;
}

/* SGD (functional_sgd.py, torch.optim.SGD's math, lazy momentum) of rows[0..n) with their gradients (n x dim,
   float32), their momentum buffers (buffers: n_rows x dim, or NULL without momentum) and their first-step
   flags (flags: one byte per row, or NULL: a zero buffer's first update is the gradient):
   g = (maximize ? -grad : grad) + weight_decay * row;
   buffer = g on a row's first step, else buffer * momentum + g * (1 - dampening);
   row -= (nesterov ? g + buffer * momentum : buffer) * lr (without momentum: row -= g * lr),
   each product-and-sum fused (fmaf) and buffer * momentum rounded first, as torch's fused SGD kernel rounds
   (its multi-tensor path for small pushes too).  With Nesterov the two paths differ: the fused kernel adds
   buffer * momentum to g before the step, the multi-tensor path steps by g and then by buffer with
   nesterov_step (-lr * momentum, rounded from double as torch rounds a Scalar); the torch path takes the
   multi-tensor one for a call's rows of fewer than least values in all (optim/kernels.py's momentum_step),
   so the kernel does the same.  (Nesterov never comes with first-step flags: SGD's requires zero dampening,
   where no flags are kept, and QHM keeps none; so the rows are never split by them.)
   0; -1 where no scratch memory could be had, -2 for a row outside the table (nothing written). */
int paramserver_sgd(const rows_t *table, const int64_t *rows, int64_t n, const float *grads, float *buffers,
                    uint8_t *flags, float lr, float momentum, float keep, float weight_decay, int32_t nesterov,
                    int32_t maximize, float nesterov_step, int64_t least) {
    int64_t dim = table->dim;
    if (check_rows(table, rows, n)) return -2;
    float *scratch = malloc((size_t)(dim + 8) * sizeof(float));
    if (!scratch) return -1;
    float step = -lr;
    int two_steps = nesterov && buffers && n * dim < least;  /* Nesterov in the multi-tensor form */
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        prefetch_ahead(table, rows, i, n, buffers, dim * (int64_t)sizeof(float));
        float *row = load_row(table, r, scratch);
        const float *grad = grads + i * dim;
        if (!buffers) {
            for (int64_t c = 0; c < dim; c++) {
                float g = maximize ? -grad[c] : grad[c];
                if (weight_decay != 0.0f) g = fmaf(row[c], weight_decay, g);
                row[c] = fmaf(g, step, row[c]);
            }
        } else {
            float *buffer = buffers + r * dim;
            int first = flags && !flags[r];
            for (int64_t c = 0; c < dim; c++) {
                float g = maximize ? -grad[c] : grad[c];
                if (weight_decay != 0.0f) g = fmaf(row[c], weight_decay, g);
                float b = first ? g : fmaf(g, keep, buffer[c] * momentum);
                buffer[c] = b;
                if (two_steps)
                    row[c] = fmaf(b, nesterov_step, fmaf(g, step, row[c]));
                else
                    row[c] = fmaf(nesterov ? fmaf(b, momentum, g) : b, step, row[c]);
            }
            if (flags) flags[r] = 1;
        }
        store_row(table, r, row);
    }
    free(scratch);
    return 0;
}

/* The updates below take a square root of each value, which vectorises only where sqrtf need not set errno:
   the kernel is built with -fno-math-errno too (no value changes; no argument here is negative). */

/* Ask for row rows[i + AHEAD]'s bytes of a second state tensor (state_bytes a row): prefetch_ahead asks for the
   row and the first.  Always inlined, as prefetch_ahead is (else its calls are deleted). */
static inline __attribute__((always_inline)) void prefetch_state_ahead(const int64_t *rows, int64_t i, int64_t n,
                                                                       const void *state, int64_t state_bytes) {
    if (i + AHEAD >= n) return;
    const char *at = (const char *)state + rows[i + AHEAD] * state_bytes;
    for (int64_t offset = 0; offset < state_bytes; offset += 64) __builtin_prefetch(at + offset, 1);
}

/* Adagrad (functional_adagrad.py, torch.optim.Adagrad's sparse update) of rows[0..n) with their gradients (n x
   dim, float32) and their sums (n_rows x dim), step being -clr (the step's rate, from the table's step count):
   g = maximize ? -grad : grad; sum += g * g; row += step * (g / (sqrt(sum) + eps)), the last product-and-sum
   fused (fmaf) as torch's add with alpha fuses it, g * g rounded before the sum (torch's pow, then add).  The
   square root is correctly rounded, as the torch path's (kernels.rounded_sqrt): rows and sums bit for bit.
   0; -1 where no scratch memory could be had, -2 for a row outside the table (nothing written). */
int paramserver_adagrad(const rows_t *table, const int64_t *rows, int64_t n, const float *grads, float *sums,
                        float step, float eps, int32_t maximize) {
    int64_t dim = table->dim;
    if (check_rows(table, rows, n)) return -2;
    float *scratch = malloc((size_t)(2 * dim + 16) * sizeof(float));  /* two rows, in turn */
    if (!scratch) return -1;
    float sign = maximize ? -1.0f : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        prefetch_ahead(table, rows, i, n, sums, dim * (int64_t)sizeof(float));
        float *row = load_row(table, r, scratch + (i & 1) * (dim + 8));
        const float *grad = grads + i * dim;
        float *sum = sums + r * dim;
        for (int64_t c = 0; c < dim; c++) {
            float g = sign * grad[c];
            float s = sum[c] + g * g;
            sum[c] = s;
            row[c] = fmaf(g / (sqrtf(s) + eps), step, row[c]);
        }
        store_row(table, r, row);
    }
    free(scratch);
    return 0;
}

enum { FTRL_POWER_ZERO = 0, FTRL_POWER_HALF = 1, FTRL_POWER_ONE = 2 };

/* n ** power for the powers the FTRL update takes (power: FTRL_POWER_*), as FunctionalFTRL computes them: 1, the
   square root (correctly rounded), n. */
static inline float ftrl_root(float value, int32_t power) {
    return power == FTRL_POWER_HALF ? sqrtf(value) : power == FTRL_POWER_ONE ? value : 1.0f;
}

/* FTRL-Proximal (ftrl.py) of rows[0..n) with their gradients (n x dim, float32), accumulators and linear terms
   (n_rows x dim each), power being -lr_power (FTRL_POWER_*: the powers computed exactly) and
   l2x2 = 2 * l2:
   n' = n + g * g; root' = n' ** power;
   sigma = (root' - n ** power) / lr; z = (z + g) - sigma * w;
   w = |z| > l1 ? (sign(z) * l1 - z) / (((root' + beta) / lr) + l2x2) : 0; n = n',
   each operation rounded as the torch path's (no product-and-sum fused).
   0; -1 where no scratch memory could be had, -2 for a row outside the table (nothing written). */
int paramserver_ftrl(const rows_t *table, const int64_t *rows, int64_t n, const float *grads, float *accumulators,
                     float *linears, float lr, int32_t power, float l1, float l2x2, float beta) {
    int64_t dim = table->dim;
    if (check_rows(table, rows, n)) return -2;
    float *scratch = malloc((size_t)(2 * dim + 16) * sizeof(float));  /* two rows, in turn */
    if (!scratch) return -1;
    int64_t state_bytes = dim * (int64_t)sizeof(float);
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        prefetch_ahead(table, rows, i, n, accumulators, state_bytes);
        prefetch_state_ahead(rows, i, n, linears, state_bytes);
        float *row = load_row(table, r, scratch + (i & 1) * (dim + 8));
        const float *grad = grads + i * dim;
        float *accumulator = accumulators + r * dim, *linear = linears + r * dim;
        for (int64_t c = 0; c < dim; c++) {
            float g = grad[c], old = accumulator[c];
            float updated = old + g * g;
            float root = ftrl_root(updated, power);
            float sigma = (root - ftrl_root(old, power)) / lr;
            float z = (linear[c] + g) - sigma * row[c];
            float shrunk = ((float)((0.0f < z) - (z < 0.0f)) * l1 - z) / (((root + beta) / lr) + l2x2);
            linear[c] = z;
            row[c] = fabsf(z) > l1 ? shrunk : 0.0f;
            accumulator[c] = updated;
        }
        store_row(table, r, row);
    }
    free(scratch);
    return 0;
}

/* Lazy Adam (functional_adam.py, torch.optim.SparseAdam's update) of rows[0..n) with their gradients (n x dim,
   float32), first and second moments (n_rows x dim each), mix1 = 1 - beta1 and mix2 = 1 - beta2 (rounded from
   double, as torch rounds a Scalar), step = -lr * sqrt(1 - beta2^t) / (1 - beta1^t) (in double from the table's
   step count t, then rounded):
   g = maximize ? -grad : grad; m += (g - m) * mix1; v += (g * g - v) * mix2; row += (m / (sqrt(v) + eps)) * step,
   each operation rounded as the torch path's (no product-and-sum fused).  The square root is correctly
   rounded, as the torch path's (kernels.rounded_sqrt): rows and moments bit for bit.
   0; -1 where no scratch memory could be had, -2 for a row outside the table (nothing written). */
int paramserver_adam(const rows_t *table, const int64_t *rows, int64_t n, const float *grads, float *exp_avgs,
                     float *exp_avg_sqs, float mix1, float mix2, float eps, float step, int32_t maximize) {
    int64_t dim = table->dim;
    if (check_rows(table, rows, n)) return -2;
    float *scratch = malloc((size_t)(2 * dim + 16) * sizeof(float));  /* two rows, in turn */
    if (!scratch) return -1;
    int64_t state_bytes = dim * (int64_t)sizeof(float);
    float sign = maximize ? -1.0f : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        prefetch_ahead(table, rows, i, n, exp_avgs, state_bytes);
        prefetch_state_ahead(rows, i, n, exp_avg_sqs, state_bytes);
        float *row = load_row(table, r, scratch + (i & 1) * (dim + 8));
        const float *grad = grads + i * dim;
        float *exp_avg = exp_avgs + r * dim, *exp_avg_sq = exp_avg_sqs + r * dim;
        for (int64_t c = 0; c < dim; c++) {
            float g = sign * grad[c];
            float m = exp_avg[c] + (g - exp_avg[c]) * mix1;
            float v = exp_avg_sq[c] + (g * g - exp_avg_sq[c]) * mix2;
            exp_avg[c] = m;
            exp_avg_sq[c] = v;
            row[c] = row[c] + (m / (sqrtf(v) + eps)) * step;
        }
        store_row(table, r, row);
    }
    free(scratch);
    return 0;
}
