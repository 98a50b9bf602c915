"""The generated float32 matrix product, the alternative to the library call that the search
measures: C source appended to a program that renders its GEMMs as `lc_sgemm` (or its
convolutions' panel products as `lc_sgemm_direct`).

Goto/BLIS structure: B is packed a KC x NC block at a time into NR-wide column panels, A an
MC x KC block at a time into MR-tall row panels (zero-padded at the edges), and a register-tiled
micro-kernel multiplies one MR x KC panel by one KC x NR panel into MR x NR accumulators. The
tile comes from the vector width the compiler targets: 8 x 48 with AVX-512 (24 of the 32
registers accumulate), 6 x 16 with AVX2 (12 of 16). Operands are addressed by row and column
strides, so transposed operands need no copy beyond the packing every product does anyway.
`lc_sgemm_direct` skips the packing for a convolution's panel: it reads A and B in place.
`lc_sgemm_pw` multiplies by a weight packed once, at compile time (`pack_weight`), so that only A
is packed at run time.
"""

import numpy as np

TILED_SGEMM = r"""
#include <stdlib.h>
#if defined(__AVX512F__)
#define LC_MR 8
#define LC_NR 48
#define LC_VW 16
#else
#define LC_MR 6
#define LC_NR 16
#define LC_VW 8
#endif
#define LC_KC 256
#define LC_MC (LC_MR * 12)
#define LC_NC (LC_NR * 22)
/* one hardware vector: a wider generic vector would be split and kept in memory, not registers */
typedef float lc_vec __attribute__((vector_size(LC_VW * 4)));
typedef float lc_vecu __attribute__((vector_size(LC_VW * 4), aligned(4)));

/* c[mr x nr] (row stride ldc) = (or +=) the accumulators of a register tile */
static inline __attribute__((always_inline)) void lc_store_tile(lc_vec acc[LC_MR][LC_NR / LC_VW], float *restrict c,
                                                                int64_t ldc, int add, int64_t mr, int64_t nr) {
    /* whole vectors stored as vectors (a tile of fewer rows too: the last tile, or 7 of 49), the
       columns past the last whole vector one by one */
    const int64_t whole = nr / LC_VW, rest = nr % LC_VW;
    for (int i = 0; i < LC_MR; ++i) {
        if (i >= mr) break;
        for (int j = 0; j < LC_NR / LC_VW; ++j) {
            if (j < whole) {
                lc_vecu *dst = (lc_vecu *)(c + i * ldc + LC_VW * j);
                *dst = add ? *dst + acc[i][j] : acc[i][j];
            } else if (j == whole && rest) {
                float part[LC_VW] __attribute__((aligned(64)));
                *(lc_vec *)part = acc[i][j];
                float *dst = c + i * ldc + LC_VW * j;
                for (int64_t q = 0; q < rest; ++q) dst[q] = add ? dst[q] + part[q] : part[q];
            }
        }
    }
}

/* a packed weight's panels are LC_PW columns wide whatever the vector width: a library rebuilt for
   another CPU reads the same weights */
#define LC_PW 16

/* c[mr x nr] (row stride ldc) = (or +=) the packed a panel (kc x `rows`, rows <= LC_MR, mr <= rows) times
   B's panel, kc deep, its first `vectors` vectors: B's row p in LC_PW-wide pieces, piece q at b + q *
   b_piece + p * b_step (a run-time packing's LC_NR-wide rows: b_piece LC_PW, b_step LC_NR; a packed
   weight's panels: b_piece kc * LC_PW, b_step LC_PW) */
static inline __attribute__((always_inline)) void lc_tile_n(int64_t kc, const float *restrict a, int rows,
                                                            const float *restrict b, int64_t b_piece, int64_t b_step,
                                                            float *restrict c, int64_t ldc, int add, int64_t mr,
                                                            int64_t nr, int vectors) {
    lc_vec acc[LC_MR][LC_NR / LC_VW];
    for (int i = 0; i < LC_MR; ++i)
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    for (int64_t p = 0; p < kc; ++p) {
        lc_vec bv[LC_NR / LC_VW];
        for (int j = 0; j < vectors; ++j)
            bv[j] = *(const lc_vecu *)(b + (LC_VW * j / LC_PW) * b_piece + p * b_step + (LC_VW * j) % LC_PW);
        for (int i = 0; i < rows; ++i) {
            const float ai = a[p * rows + i];
            for (int j = 0; j < vectors; ++j) acc[i][j] += ai * bv[j];
        }
    }
    lc_store_tile(acc, c, ldc, add, mr, nr);
}

/* lc_tile_n in as few vectors as the tile's nr columns need (the last columns of a product) */
static inline __attribute__((always_inline)) void lc_tile(int64_t kc, const float *restrict a, int rows, const float *restrict b,
                                                          int64_t b_piece, int64_t b_step,
                                                          float *restrict c, int64_t ldc, int add, int64_t mr, int64_t nr) {
    if (nr <= LC_VW) lc_tile_n(kc, a, rows, b, b_piece, b_step, c, ldc, add, mr, nr, 1);
    else if (nr <= 2 * LC_VW && LC_NR > 2 * LC_VW) lc_tile_n(kc, a, rows, b, b_piece, b_step, c, ldc, add, mr, nr, 2);
    else lc_tile_n(kc, a, rows, b, b_piece, b_step, c, ldc, add, mr, nr, LC_NR / LC_VW);
}

/* lc_tile for a panel `rows` tall (packed so): a product of 49 rows runs 7 tiles of 7, not 7 of 8 */
static void lc_tile_rows(int64_t kc, const float *restrict a, int rows, const float *restrict b, int64_t b_piece,
                         int64_t b_step, float *restrict c, int64_t ldc, int add, int64_t mr, int64_t nr) {
    switch (rows) {
#define LC_ROWS(R) case R: lc_tile(kc, a, R, b, b_piece, b_step, c, ldc, add, mr, nr); return;
    LC_ROWS(1) LC_ROWS(2) LC_ROWS(3) LC_ROWS(4) LC_ROWS(5) LC_ROWS(6)
#if LC_MR >= 8
    LC_ROWS(7) LC_ROWS(8)
#endif
#undef LC_ROWS
    default: lc_tile(kc, a, LC_MR, b, b_piece, b_step, c, ldc, add, mr, nr);
    }
}

/* rows as even as whole tiles allow: the height of the tiles that cover mc rows */
static inline int lc_even_rows(int64_t mc) {
    const int64_t tiles = (mc + LC_MR - 1) / LC_MR;
    return (int)((mc + tiles - 1) / tiles);
}

/* the packed a panel (kc x LC_MR) times the packed b panel (kc x LC_NR) */
static void lc_micro(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c, int64_t ldc,
                     int add, int64_t mr, int64_t nr) {
    lc_tile(kc, a, LC_MR, b, LC_PW, LC_NR, c, ldc, add, mr, nr);
}

/* c[mr x nr] (row stride ldc) = (or +=) A's rows (i, p) at a[i * ars + p * acs] times B's rows p at
   b + p * ldb, the first `vectors` vectors of LC_NR columns each, read in place: no packing */
static inline __attribute__((always_inline)) void lc_micro_direct_n(int64_t kc, const float *a, int64_t ars, int64_t acs,
                                                                    const float *b, int64_t ldb, float *restrict c,
                                                                    int64_t ldc, int add, int64_t mr, int64_t nr,
                                                                    int vectors) {
    lc_vec acc[LC_MR][LC_NR / LC_VW];
    const float *row[LC_MR];
    for (int i = 0; i < LC_MR; ++i) {
        row[i] = a + (i < mr ? i : mr - 1) * ars;  /* rows past mr repeat the last: read, not stored */
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    }
    for (int64_t p = 0; p < kc; ++p) {
        lc_vec bv[LC_NR / LC_VW];
        for (int j = 0; j < vectors; ++j) bv[j] = *(const lc_vecu *)(b + p * ldb + LC_VW * j);
        for (int i = 0; i < LC_MR; ++i) {
            const float ai = row[i][p * acs];
            for (int j = 0; j < vectors; ++j) acc[i][j] += ai * bv[j];
        }
    }
    lc_store_tile(acc, c, ldc, add, mr, nr);
}

/* lc_micro_direct_n as wide as the tile's columns need: a last strip a vector or two wide (49 columns
   are a tile and 1) multiplies no padding vectors */
static inline void lc_micro_direct(int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b,
                                   int64_t ldb, float *restrict c, int64_t ldc, int add, int64_t mr, int64_t nr) {
    if (nr <= LC_VW) lc_micro_direct_n(kc, a, ars, acs, b, ldb, c, ldc, add, mr, nr, 1);
    else if (nr <= 2 * LC_VW && LC_NR > 2 * LC_VW) lc_micro_direct_n(kc, a, ars, acs, b, ldb, c, ldc, add, mr, nr, 2);
    else lc_micro_direct_n(kc, a, ars, acs, b, ldb, c, ldc, add, mr, nr, LC_NR / LC_VW);
}

/* A's (i, p) at a[i * ars + p * acs], for i < mc, p < kc, into mr-tall panels (zero-padded) */
static void lc_pack_a(int64_t mc, int64_t kc, const float *a, int64_t ars, int64_t acs, int64_t mr_tile, float *restrict out) {
    for (int64_t i0 = 0; i0 < mc; i0 += mr_tile, out += kc * mr_tile) {
        const int64_t mr = mc - i0 < mr_tile ? mc - i0 : mr_tile;
        for (int64_t p = 0; p < kc; ++p) {
            for (int64_t i = 0; i < mr; ++i) out[p * mr_tile + i] = a[(i0 + i) * ars + p * acs];
            for (int64_t i = mr; i < mr_tile; ++i) out[p * mr_tile + i] = 0.0f;
        }
    }
}

/* B's (p, j) at b[p * brs + j * bcs], for p < kc, j < nc, into NR-wide panels */
static void lc_pack_b(int64_t kc, int64_t nc, const float *b, int64_t brs, int64_t bcs, float *restrict out) {
    for (int64_t j0 = 0; j0 < nc; j0 += LC_NR, out += kc * LC_NR) {
        const int64_t nr = nc - j0 < LC_NR ? nc - j0 : LC_NR;
        if (bcs == 1 && nr == LC_NR) {
            for (int64_t p = 0; p < kc; ++p) memcpy(out + p * LC_NR, b + p * brs + j0, sizeof(float) * LC_NR);
            continue;
        }
        for (int64_t p = 0; p < kc; ++p) {
            for (int64_t j = 0; j < nr; ++j) out[p * LC_NR + j] = b[p * brs + (j0 + j) * bcs];
            for (int64_t j = nr; j < LC_NR; ++j) out[p * LC_NR + j] = 0.0f;
        }
    }
}

/* C[m, n] (row stride ldc) = A B with B's rows at b + p * ldb (columns contiguous), both read in
   place (B a panel computed into cache, A a convolution's small weights), on the calling thread;
   the last strip of fewer than LC_NR columns is packed, zero-padded, so that no read passes the
   end of a row */
static void lc_sgemm_direct(int64_t m, int64_t n, int64_t k, const float *a, int64_t ars, int64_t acs,
                            const float *b, int64_t ldb, float *c, int64_t ldc) {
    float edge[LC_KC * LC_NR] __attribute__((aligned(64)));
    for (int64_t pc = 0; pc < k; pc += LC_KC) {
        const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;
        for (int64_t j0 = 0; j0 < n; j0 += LC_NR) {
            const int64_t nr = n - j0 < LC_NR ? n - j0 : LC_NR;
            const float *strip = b + pc * ldb + j0;
            int64_t ld = ldb;
            if (nr < LC_NR) {
                lc_pack_b(kc, nr, strip, ldb, 1, edge);
                strip = edge;
                ld = LC_NR;
            }
            for (int64_t i0 = 0; i0 < m; i0 += LC_MR)
                lc_micro_direct(kc, a + i0 * ars + pc * acs, ars, acs, strip, ld, c + i0 * ldc + j0, ldc, pc > 0,
                                m - i0 < LC_MR ? m - i0 : LC_MR, nr);
        }
    }
}

/* C[m, n] (row stride ldc) = A B on the calling thread; the packing buffers are the thread's own,
   allocated on its first product and kept (about 1 MB a thread) */
static void lc_sgemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t ars, int64_t acs,
                    const float *b, int64_t brs, int64_t bcs, float *c, int64_t ldc) {
    static __thread float *packed_a, *packed_b;
    if (!packed_a) {
        packed_a = aligned_alloc(64, sizeof(float) * LC_MC * LC_KC);
        packed_b = aligned_alloc(64, sizeof(float) * LC_NC * LC_KC);
        if (!packed_a || !packed_b) { free(packed_a); free(packed_b); packed_a = packed_b = 0; lc_no_memory = 1; return; }
    }
    for (int64_t jc = 0; jc < n; jc += LC_NC) {
        const int64_t nc = n - jc < LC_NC ? n - jc : LC_NC;
        for (int64_t pc = 0; pc < k; pc += LC_KC) {
            const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;
            lc_pack_b(kc, nc, b + pc * brs + jc * bcs, brs, bcs, packed_b);
            for (int64_t ic = 0; ic < m; ic += LC_MC) {
                const int64_t mc = m - ic < LC_MC ? m - ic : LC_MC;
                lc_pack_a(mc, kc, a + ic * ars + pc * acs, ars, acs, LC_MR, packed_a);
                for (int64_t jr = 0; jr < nc; jr += LC_NR)
                    for (int64_t ir = 0; ir < mc; ir += LC_MR)
                        lc_micro(kc, packed_a + ir * kc, packed_b + jr * kc, c + (ic + ir) * ldc + jc + jr, ldc, pc > 0,
                                 mc - ir < LC_MR ? mc - ir : LC_MR, nc - jr < LC_NR ? nc - jr : LC_NR);
            }
        }
    }
}

/* A weight B packed once, at compile time, by c_gemm.pack_weight: for each block of LC_KC rows, the
   block's columns in panels LC_PW wide, each panel kc x LC_PW row-major, the last zero-padded; a
   register tile LC_NR wide reads LC_NR / LC_PW neighbouring panels. */

/* c[0, j0 .. j0 + nr) = (or +=) the row a (kc long) times two neighbouring panels at b: a row of A
   times the weight streams each panel once, where a register tile would multiply LC_MR - 1 rows of
   padding */
static inline void lc_row_pw(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                             int add, int64_t nr) {
    lc_vec acc[2][2 * LC_PW / LC_VW];
    for (int u = 0; u < 2; ++u)
        for (int j = 0; j < 2 * LC_PW / LC_VW; ++j) acc[u][j] = (lc_vec){0};
    const float *b1 = b + kc * LC_PW;
    int64_t p = 0;
    for (; p + 1 < kc; p += 2)  /* two partial sums: twice the independent FMA chains */
        for (int u = 0; u < 2; ++u)
            for (int j = 0; j < LC_PW / LC_VW; ++j) {
                acc[u][j] += a[p + u] * *(const lc_vecu *)(b + (p + u) * LC_PW + LC_VW * j);
                if (nr > LC_PW) acc[u][LC_PW / LC_VW + j] += a[p + u] * *(const lc_vecu *)(b1 + (p + u) * LC_PW + LC_VW * j);
            }
    for (; p < kc; ++p)
        for (int j = 0; j < LC_PW / LC_VW; ++j) {
            acc[0][j] += a[p] * *(const lc_vecu *)(b + p * LC_PW + LC_VW * j);
            if (nr > LC_PW) acc[0][LC_PW / LC_VW + j] += a[p] * *(const lc_vecu *)(b1 + p * LC_PW + LC_VW * j);
        }
    float out[2 * LC_PW] __attribute__((aligned(64)));
    for (int j = 0; j < 2 * LC_PW / LC_VW; ++j) *(lc_vec *)(out + LC_VW * j) = acc[0][j] + acc[1][j];
    for (int64_t j = 0; j < nr; ++j) c[j] = add ? c[j] + out[j] : out[j];
}

/* columns [j_lo, j_hi) of C[m, n] (row stride ldc; c points at column 0) = A B, B a packed weight of
   k rows whose panels cover npad columns (n rounded up to a whole register tile of the widest
   target); j_lo a multiple of LC_PW (a tile reads only the panels its columns need). On
   the calling thread; A's packing buffer is the thread's own, as lc_sgemm's. */
static void lc_sgemm_pw(int64_t m, int64_t k, const float *a, int64_t ars, int64_t acs, const float *pb,
                        int64_t npad, int64_t j_lo, int64_t j_hi, float *c, int64_t ldc) {
    if (m == 1 && acs == 1) {
        for (int64_t pc = 0; pc < k; pc += LC_KC) {
            const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;
            for (int64_t j = j_lo; j < j_hi; j += 2 * LC_PW)
                lc_row_pw(kc, a + pc, pb + pc * npad + j * kc, c + j, pc > 0, j_hi - j < 2 * LC_PW ? j_hi - j : 2 * LC_PW);
        }
        return;
    }
    static __thread float *packed_a;
    if (!packed_a) {
        packed_a = aligned_alloc(64, sizeof(float) * LC_MC * LC_KC);
        if (!packed_a) { lc_no_memory = 1; return; }
    }
    for (int64_t jc = j_lo; jc < j_hi; jc += LC_NC) {
        const int64_t nc = j_hi - jc < LC_NC ? j_hi - jc : LC_NC;
        for (int64_t pc = 0; pc < k; pc += LC_KC) {
            const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;
            const float *block = pb + pc * npad;  /* this block's panels: panel j / LC_PW at j * kc */
            for (int64_t ic = 0; ic < m; ic += LC_MC) {
                const int64_t mc = m - ic < LC_MC ? m - ic : LC_MC;
                const int rows = lc_even_rows(mc);
                lc_pack_a(mc, kc, a + ic * ars + pc * acs, ars, acs, rows, packed_a);
                for (int64_t jr = 0; jr < nc; jr += LC_NR)
                    for (int64_t ir = 0; ir < mc; ir += rows)
                        lc_tile_rows(kc, packed_a + ir * kc, rows, block + (jc + jr) * kc, kc * LC_PW, LC_PW,
                                     c + (ic + ir) * ldc + jc + jr, ldc, pc > 0, mc - ir < rows ? mc - ir : rows,
                                     nc - jr < LC_NR ? nc - jr : LC_NR);
            }
        }
    }
}

/* positions (C's columns) of a transposed product's chunk: its C^T stays in L2 until transposed */
#define LC_T_CHUNK LC_MC

/* rows [i_lo, i_hi) x columns [j_lo, j_hi) of C[m, n] (row stride ldc; c points at C[0, 0]) = A B,
   A a weight packed transposed at compile time (pat: pack_weight(A^T), its m columns padded to
   mpad), B's (p, j) at b[p * brs + j * bcs]: computed as C^T = B^T A^T, a chunk of C's columns at a
   time into the thread's scratch, then transposed into C. A product of few columns (a small
   image's positions) then fills whole register tiles along the long side, reads a weight packed
   once instead of packing it per call, and packs only B. i_lo a multiple of LC_PW. */
static void lc_sgemm_t(int64_t k, const float *b, int64_t brs, int64_t bcs, const float *pat, int64_t mpad,
                       int64_t i_lo, int64_t i_hi, int64_t j_lo, int64_t j_hi, float *c, int64_t ldc) {
    static __thread float *ct;
    static __thread int64_t ct_size;
    const int64_t span = i_hi - i_lo;
    if (span <= 0 || j_hi <= j_lo) return;
    if (LC_T_CHUNK * span > ct_size) {
        free(ct);
        ct = aligned_alloc(64, sizeof(float) * (size_t)((LC_T_CHUNK * span + 15) / 16 * 16));
        ct_size = ct ? LC_T_CHUNK * span : 0;
        if (!ct) { lc_no_memory = 1; return; }
    }
    for (int64_t j0 = j_lo; j0 < j_hi; j0 += LC_T_CHUNK) {
        const int64_t cn = j_hi - j0 < LC_T_CHUNK ? j_hi - j0 : LC_T_CHUNK;
        /* C^T's chunk [cn x span], addressed from column i_lo: lc_sgemm_pw writes columns [i_lo, i_hi) */
        lc_sgemm_pw(cn, k, b + j0 * bcs, bcs, brs, pat, mpad, i_lo, i_hi, ct - i_lo, span);
        /* in squares of 16: both sides' reads and writes stay within a few cache lines */
        for (int64_t ib = 0; ib < span; ib += 16)
            for (int64_t jb = 0; jb < cn; jb += 16) {
                const int64_t ie = ib + 16 < span ? ib + 16 : span, je = jb + 16 < cn ? jb + 16 : cn;
                for (int64_t i = ib; i < ie; ++i)
                    for (int64_t j = jb; j < je; ++j) c[(i_lo + i) * ldc + j0 + j] = ct[j * span + i];
            }
    }
}
"""

# A convolution's product computed transposed with its windows read in place (needs TILED_SGEMM's
# tile and packed-weight layout): each task copies the input rows it reads into scratch channels
# innermost, zero-padded, so that a window's (channel, row, column) is one offset from the window's
# origin; a register tile is LC_MR output positions (their windows' values broadcast) by LC_NR output
# channels (the weight packed as A^T's panels at compile time), summed over all of k in registers and
# stored transposed into C. Nothing is materialized per window: no im2col panel, no packing of B.
DIRECT_SGEMM = r"""
#include <immintrin.h>

/* dst[r * dst_stride + q] = src[q * src_stride + r] for r < 8, q < `columns` (at most 8; src's rows
   past it are read, not stored): an 8 x 8 block transposed, in registers where the CPU has AVX (the
   channels-last copy and the transposed store move blocks) */
static inline __attribute__((always_inline)) void lc_transpose8(const float *src, int64_t src_stride, float *dst,
                                                                int64_t dst_stride, int columns) {
#if defined(__AVX2__)
    __m256 r[8], t[8], u[8];
    for (int q = 0; q < 8; ++q) r[q] = _mm256_loadu_ps(src + q * src_stride);
    for (int q = 0; q < 4; ++q) {
        t[2 * q] = _mm256_unpacklo_ps(r[2 * q], r[2 * q + 1]);
        t[2 * q + 1] = _mm256_unpackhi_ps(r[2 * q], r[2 * q + 1]);
    }
    for (int h = 0; h < 2; ++h) {  /* rows 0-3 (h 0) and 4-7 (h 1) of the source */
        u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    if (columns == 8)
        for (int q = 0; q < 4; ++q) {
            _mm256_storeu_ps(dst + q * dst_stride, _mm256_permute2f128_ps(u[q], u[4 + q], 0x20));
            _mm256_storeu_ps(dst + (4 + q) * dst_stride, _mm256_permute2f128_ps(u[q], u[4 + q], 0x31));
        }
    else {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(columns), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int q = 0; q < 4; ++q) {
            _mm256_maskstore_ps(dst + q * dst_stride, mask, _mm256_permute2f128_ps(u[q], u[4 + q], 0x20));
            _mm256_maskstore_ps(dst + (4 + q) * dst_stride, mask, _mm256_permute2f128_ps(u[q], u[4 + q], 0x31));
        }
    }
#else
    for (int q = 0; q < columns; ++q)
        for (int r = 0; r < 8; ++r) dst[r * dst_stride + q] = src[q * src_stride + r];
#endif
}
/* tile[i * LC_NR + ..] = the window at at[i] (i < count; element p at at[i][off[p]]) times A^T's
   packed panels from column j0, `vectors` vectors of them, over all k */
static inline __attribute__((always_inline)) void lc_direct_tile_n(int64_t k, const float *const *at, int count,
                                                                   const int64_t *restrict off, const float *restrict pat,
                                                                   int64_t mpad, int64_t j0, float *restrict tile, int vectors) {
    lc_vec acc[LC_MR][LC_NR / LC_VW];
    const float *row[LC_MR];
    for (int i = 0; i < LC_MR; ++i) {
        row[i] = at[i < count ? i : 0];
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    }
    for (int64_t pc = 0; pc < k; pc += LC_KC) {
        const int64_t kc = k - pc < LC_KC ? k - pc : LC_KC;
        const float *restrict b = pat + pc * mpad + j0 * kc;  /* this block's panel j0 / LC_PW */
        const int64_t *restrict o = off + pc;
        for (int64_t p = 0; p < kc; ++p) {
            lc_vec bv[LC_NR / LC_VW];
            for (int j = 0; j < vectors; ++j)
                bv[j] = *(const lc_vecu *)(b + (LC_VW * j / LC_PW) * kc * LC_PW + p * LC_PW + (LC_VW * j) % LC_PW);
            const int64_t q = o[p];
            for (int i = 0; i < count; ++i) {
                const float ai = row[i][q];
                for (int j = 0; j < vectors; ++j) acc[i][j] += ai * bv[j];
            }
        }
    }
    for (int i = 0; i < count; ++i)
        for (int j = 0; j < vectors; ++j) *(lc_vec *)(tile + i * LC_NR + LC_VW * j) = acc[i][j];
}

/* lc_direct_tile_n in as few vectors as nr channels need */
static inline __attribute__((always_inline)) void lc_direct_tile_v(int64_t k, const float *const *at, int count,
                                                                   const int64_t *restrict off, const float *restrict pat,
                                                                   int64_t mpad, int64_t j0, float *restrict tile, int64_t nr) {
    if (nr <= LC_VW) lc_direct_tile_n(k, at, count, off, pat, mpad, j0, tile, 1);
    else if (nr <= 2 * LC_VW && LC_NR > 2 * LC_VW) lc_direct_tile_n(k, at, count, off, pat, mpad, j0, tile, 2);
    else lc_direct_tile_n(k, at, count, off, pat, mpad, j0, tile, LC_NR / LC_VW);
}

/* lc_direct_tile_v for `count` positions, a constant in each case: the accumulators stay in registers */
static void lc_direct_tile(int64_t k, const float *const *at, int count, const int64_t *restrict off,
                           const float *restrict pat, int64_t mpad, int64_t j0, float *restrict tile, int64_t nr) {
    switch (count) {
#define LC_COUNT(R) case R: lc_direct_tile_v(k, at, R, off, pat, mpad, j0, tile, nr); return;
    LC_COUNT(1) LC_COUNT(2) LC_COUNT(3) LC_COUNT(4) LC_COUNT(5)
#if LC_MR >= 8
    LC_COUNT(6) LC_COUNT(7)
#endif
#undef LC_COUNT
    default: lc_direct_tile_v(k, at, LC_MR, off, pat, mpad, j0, tile, nr);
    }
}

/* Output rows [r0, r1) of C[m, n] (row stride n; channels [m_lo, m_hi), m_lo a multiple of LC_PW) = the
   windows of image x times A, A^T packed at pat (mpad columns), on the calling thread. g: channels,
   channel stride, then for y and for x: window extent, dilation, step, pad, input size, element
   stride, output extent. */
static void lc_conv_direct(const int64_t *g, const float *x, const float *pat, int64_t mpad, int64_t m_lo, int64_t m_hi,
                           float *c, int64_t n, int64_t r0, int64_t r1) {
    const int64_t channels = g[0], cs = g[1], *gy = g + 2, *gx = g + 9, ow = gx[6];
    /* the input rows and columns the windows read, from (r0 * step - pad, -pad) */
    const int64_t iy0 = r0 * gy[2] - gy[3], rows_in = (r1 - 1 - r0) * gy[2] + (gy[0] - 1) * gy[1] + 1;
    const int64_t wp = (ow - 1) * gx[2] + (gx[0] - 1) * gx[1] + 1, k = channels * gy[0] * gx[0];
    const int64_t cells = (rows_in * wp * channels + 15) / 16 * 16;
    float *xs = (float *)lc_scratch((int64_t)sizeof(float) * cells + (int64_t)sizeof(int64_t) * k);
    if (!xs) return;
    int64_t *off = (int64_t *)(xs + cells);
    /* columns u of a row read the input's column u - pad: inside it for u in [u_lo, u_hi) */
    int64_t u_lo = gx[3] < wp ? gx[3] : wp, u_hi = gx[3] + gx[4] < wp ? gx[3] + gx[4] : wp;
    if (u_hi < u_lo) u_hi = u_lo;
    for (int64_t r = 0; r < rows_in; ++r) {
        const int64_t iy = iy0 + r;
        float *dst = xs + r * wp * channels;
        if (iy < 0 || iy >= gy[4]) { memset(dst, 0, sizeof(float) * wp * channels); continue; }
        memset(dst, 0, sizeof(float) * u_lo * channels);
        memset(dst + u_hi * channels, 0, sizeof(float) * (wp - u_hi) * channels);
        const float *row = x + iy * gy[5] + (u_lo - gx[3]) * gx[5];
        float *to = dst + u_lo * channels;
        int64_t ch = 0, u = 0;
        if (gx[5] == 1)  /* 8 channels by 8 columns at a time */
            for (; ch + 8 <= channels; ch += 8) {
                for (u = 0; u + 8 <= u_hi - u_lo; u += 8) lc_transpose8(row + ch * cs + u, cs, to + u * channels + ch, channels, 8);
                for (int64_t q = ch; q < ch + 8; ++q)
                    for (int64_t v = u; v < u_hi - u_lo; ++v) to[v * channels + q] = row[q * cs + v];
            }
        for (; ch < channels; ++ch)
            for (u = 0; u < u_hi - u_lo; ++u) to[u * channels + ch] = row[ch * cs + u * gx[5]];
    }
    for (int64_t ch = 0, p = 0; ch < channels; ++ch)
        for (int64_t i = 0; i < gy[0]; ++i)
            for (int64_t j = 0; j < gx[0]; ++j, ++p) off[p] = (i * gy[1] * wp + j * gx[1]) * channels + ch;
    /* positions in tiles as even as whole tiles allow: 49 are 7 tiles of 7, not 6 of 8 and one of 1 */
    float tile[LC_MR * LC_NR] __attribute__((aligned(64)));
    const int64_t first = r0 * ow, positions = (r1 - r0) * ow, tiles = (positions + LC_MR - 1) / LC_MR;
    /* a panel of channels outside the positions: its weight (k x LC_NR) stays in L2 while every
       tile reads it, where a tile outside would stream the whole weight (past L2 at 256 channels) */
    for (int64_t j0 = m_lo; j0 < m_hi; j0 += LC_NR) {
        const int64_t nr = m_hi - j0 < LC_NR ? m_hi - j0 : LC_NR;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t q0 = first + positions * t / tiles;
            const int count = (int)(first + positions * (t + 1) / tiles - q0);
            const float *at[LC_MR];
            for (int i = 0; i < count; ++i) {
                const int64_t oy = (q0 + i) / ow, ox = (q0 + i) % ow;
                at[i] = xs + ((oy - r0) * gy[2] * wp + ox * gx[2]) * channels;
            }
            lc_direct_tile(k, at, count, off, pat, mpad, j0, tile, nr);
            int64_t jj = 0;
            if (LC_MR == 8)  /* C^T's tile stored into C 8 channels by `count` positions at a time */
                for (; jj + 8 <= nr; jj += 8) lc_transpose8(tile + jj, LC_NR, c + (j0 + jj) * n + q0, n, count);
            for (; jj < nr; ++jj)
                for (int i = 0; i < count; ++i) c[(j0 + jj) * n + q0 + i] = tile[i * LC_NR + jj];
        }
    }
}
"""

# A product whose B a generated loop computes (an int8 weight widened, "dequantized" products; needs
# TILED_SGEMM): each thread widens strips of B (LC_KC x LC_NR) into scratch and multiplies every row
# of A by each at once, so each weight is widened once per call whatever the rows.
STRIP_SGEMM = r"""
#include <immintrin.h>

/* out[0 .. count) = q[j]: a row of an int8 weight widened, a vector at a time (GCC's vector conversions
   from int8 are scalar code; its scale multiplies C's columns after the product); the row `ahead`
   elements on is prefetched (B's rows lie far apart: the hardware fetches none ahead) */
static inline __attribute__((always_inline)) void lc_widen_int8(int64_t count, const int8_t *q, int64_t ahead,
                                                                float *restrict out) {
    __builtin_prefetch(q + ahead);
    __builtin_prefetch(q + ahead + count - 1);
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= count; j += 16)
        _mm512_storeu_ps(out + j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j)))));
#elif defined(__AVX2__)
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(out + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)))));
#endif
    for (; j < count; ++j) out[j] = (float)q[j];
}

/* c[0, 0 .. nr) = (or +=) the row a (kc long, column stride acs) times a strip (kc x LC_NR row-major, its
   columns past nr zero): a row left below a register tile's height streams the strip once, where the tile
   would multiply LC_MR - 1 copies of it */
static inline void lc_row_strip(int64_t kc, const float *a, int64_t acs, const float *restrict b, float *restrict c,
                                int add, int64_t nr) {
    lc_vec acc[2][LC_NR / LC_VW];
    for (int u = 0; u < 2; ++u)
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[u][j] = (lc_vec){0};
    int64_t p = 0;
    for (; p + 1 < kc; p += 2)  /* two partial sums: twice the independent FMA chains */
        for (int u = 0; u < 2; ++u)
            for (int j = 0; j < LC_NR / LC_VW; ++j) acc[u][j] += a[(p + u) * acs] * *(const lc_vecu *)(b + (p + u) * LC_NR + LC_VW * j);
    for (; p < kc; ++p)
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[0][j] += a[p * acs] * *(const lc_vecu *)(b + p * LC_NR + LC_VW * j);
    float out[LC_NR] __attribute__((aligned(64)));
    for (int j = 0; j < LC_NR / LC_VW; ++j) *(lc_vec *)(out + LC_VW * j) = acc[0][j] + acc[1][j];
    for (int64_t j = 0; j < nr; ++j) c[j] = add ? c[j] + out[j] : out[j];
}

/* C's rows [0, m) (row stride ldc), columns [0, nr) at c = (or +=) A's rows (a[i * ars + p * acs], p < kc,
   read in place) times a strip of B (kc x LC_NR row-major, its columns past nr zero): register tiles of
   LC_MR rows, the last few rows (at most half a tile) one at a time */
static void lc_strip_product(int64_t m, int64_t kc, const float *a, int64_t ars, int64_t acs, const float *strip,
                             float *c, int64_t ldc, int add, int64_t nr) {
    int64_t i0 = 0;
    for (; i0 < m && 2 * (m - i0) > LC_MR; i0 += LC_MR)
        lc_micro_direct(kc, a + i0 * ars, ars, acs, strip, LC_NR, c + i0 * ldc, ldc, add, m - i0 < LC_MR ? m - i0 : LC_MR, nr);
    for (; i0 < m; ++i0) lc_row_strip(kc, a + i0 * ars, acs, strip, c + i0 * ldc, add, nr);
}
"""

# the packed weight's layout, which lc_sgemm_pw reads (LC_PW and LC_KC above)
PANEL_WIDTH = 16
PANEL_DEPTH = 256
# its columns are padded to a multiple of the widest register tile (LC_NR with AVX-512): a tile at
# the last columns reads all of its panels, and read past the array's end when there were fewer
PANEL_COLUMNS = 48


def padded_columns(n: int) -> int:
    """The columns a packed weight of n columns holds (lc_sgemm_pw's npad)."""
    return -(-n // PANEL_COLUMNS) * PANEL_COLUMNS


def pack_weight(b: np.ndarray) -> np.ndarray:
    """B [k, n] in lc_sgemm_pw's layout, flat: for each block of PANEL_DEPTH rows, its columns
    (zero-padded to padded_columns) in panels PANEL_WIDTH wide, each panel row-major."""
    k, n = b.shape
    npad = padded_columns(n)
    padded = np.zeros((k, npad), np.float32)
    padded[:, :n] = b
    blocks = [
        padded[pc : pc + PANEL_DEPTH].reshape(-1, npad // PANEL_WIDTH, PANEL_WIDTH).transpose(1, 0, 2).ravel()
        for pc in range(0, k, PANEL_DEPTH)
    ]
    return np.concatenate(blocks)


# A convolution's product with B read in place from the input (an implicit GEMM; needs TILED_SGEMM's
# tile): the rows of the input that a block of output rows reads are copied once, split by phase
# (position = step*(o + q) + r), so that every window reads its phase plane at stride 1. B's row
# (c, i, j) is then the plane offset `off[row]` plus the column, a column being an output position
# in the planes' row pitch (its last `reach` columns of each row are junk: computed, never stored).
CONV_SGEMM = r"""
/* the convolution's own register tile: m is mostly a multiple of 8, which 6 does not divide */
#if defined(__AVX512F__)
#define LC_CMR 8
#define LC_CNR 48
#else
#define LC_CMR 4
#define LC_CNR 24
#endif
#define LC_CONV_NC (LC_CNR * (128 / LC_CNR > 0 ? 128 / LC_CNR : 1))
#define LC_CONV_L1 (48 * 1024)

/* c[LC_CMR x LC_VW * vectors] (row stride LC_CONV_NC) = (or +=) A's packed panel (kc x LC_CMR) times
   B's rows p at b + off[p] */
static inline __attribute__((always_inline)) void lc_micro_rows_n(int64_t kc, const float *restrict a, const float *b,
                                                                  const int64_t *restrict off, float *restrict c,
                                                                  int add, int vectors) {
    lc_vec acc[LC_CMR][LC_CNR / LC_VW];
    for (int i = 0; i < LC_CMR; ++i)
        for (int j = 0; j < LC_CNR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    for (int64_t p = 0; p < kc; ++p) {
        const float *bp = b + off[p];
        lc_vec bv[LC_CNR / LC_VW];
        for (int j = 0; j < vectors; ++j) bv[j] = *(const lc_vecu *)(bp + LC_VW * j);
        for (int i = 0; i < LC_CMR; ++i) {
            const float ai = a[p * LC_CMR + i];
            for (int j = 0; j < vectors; ++j) acc[i][j] += ai * bv[j];
        }
    }
    for (int i = 0; i < LC_CMR; ++i)
        for (int j = 0; j < vectors; ++j) {
            lc_vec *dst = (lc_vec *)(c + i * LC_CONV_NC + LC_VW * j);
            *dst = add ? *dst + acc[i][j] : acc[i][j];
        }
}

/* lc_micro_rows_n for `columns` (at most LC_CNR) columns, in as few vectors as they need: the last
   tile of a block of a small image's rows (14 rows of 16 are 4 tiles and 32 columns) */
static void lc_micro_rows(int64_t kc, const float *restrict a, const float *b, const int64_t *restrict off,
                          float *restrict c, int add, int64_t columns) {
    if (columns <= LC_VW) lc_micro_rows_n(kc, a, b, off, c, add, 1);
    else if (columns <= 2 * LC_VW && LC_CNR > 2 * LC_VW) lc_micro_rows_n(kc, a, b, off, c, add, 2);
    else lc_micro_rows_n(kc, a, b, off, c, add, LC_CNR / LC_VW);
}

/* a number per run of a convolution kernel: the key of each thread's packed A */
static int64_t lc_conv_calls;

/* Output rows [r0, r1) of C[m, oh*ow] (row stride ldc) = A B, B the windows of input x, on the
   calling thread. g: channels, channel stride, then for y and for x: window extent, dilation, step,
   pad, input size, element stride, output extent, phases read (a bit mask), reach. */
static void lc_conv_rows(const int64_t *g, const float *x, int64_t m, const float *a, int64_t ars, int64_t acs,
                         float *c, int64_t ldc, int64_t r0, int64_t r1, int64_t call) {
    const int64_t channels = g[0], cs = g[1], *gy = g + 2, *gx = g + 11;
    int64_t phase_y[64], phase_x[64], ny = 0, nx = 0;  /* a used phase's plane index, by phase */
    for (int64_t r = 0; r < gy[2]; ++r) phase_y[r] = (gy[7] >> r) & 1 ? ny++ : -1;
    for (int64_t r = 0; r < gx[2]; ++r) phase_x[r] = (gx[7] >> r) & 1 ? nx++ : -1;
    const int64_t ow = gx[6], qw = ow + gx[8], qh = r1 - r0 + gy[8], plane = qh * qw;
    const int64_t k = channels * gy[0] * gx[0], columns = (r1 - r0) * qw;
    /* the scratch's parts start on 64-byte boundaries (16 floats) */
    const int64_t planes = channels * ny * nx * plane, room = (planes + 2 * LC_CNR + qw + 15) / 16 * 16;
    const int64_t tiles = (m + LC_CMR - 1) / LC_CMR, sums = tiles * LC_CMR * LC_CONV_NC;
    float *xq = (float *)lc_scratch((int64_t)sizeof(float) * (room + sums) + (int64_t)sizeof(int64_t) * k);
    if (!xq) return;
    float *sum = xq + room;  /* a chunk of C's columns, padded rows included */
    int64_t *off = (int64_t *)(sum + sums);
    /* A in LC_CMR-tall panels, zero-padded: one contiguous read per row of B; packed once per call
       (`call`, a number per kernel run) and operand on each thread, which keeps it across its tasks */
    static __thread float *packed;
    static __thread int64_t packed_size, packed_call = -1, packed_m;
    static __thread const float *packed_a;
    if (packed_call != call || packed_a != a || packed_m != m) {
        if (tiles * LC_CMR * k > packed_size) {
            free(packed);
            packed = aligned_alloc(64, sizeof(float) * (size_t)((tiles * LC_CMR * k + 15) / 16 * 16));
            packed_size = packed ? tiles * LC_CMR * k : 0;
            if (!packed) { lc_no_memory = 1; packed_call = -1; return; }
        }
        lc_pack_a(m, k, a, ars, acs, LC_CMR, packed);
        packed_call = call, packed_a = a, packed_m = m;
    }
    for (int64_t ch = 0; ch < channels; ++ch)
        for (int64_t ry = 0; ry < gy[2]; ++ry) {
            if (phase_y[ry] < 0) continue;
            for (int64_t rx = 0; rx < gx[2]; ++rx) {
                if (phase_x[rx] < 0) continue;
                float *dst = xq + ((ch * ny + phase_y[ry]) * nx + phase_x[rx]) * plane;
                /* the plane's columns u read the input at step*u + rx - pad: inside it for u in [lo, hi) */
                const int64_t first = rx - gx[3], lo = first >= 0 ? 0 : (-first + gx[2] - 1) / gx[2];
                int64_t hi = gx[4] - first <= 0 ? 0 : (gx[4] - first + gx[2] - 1) / gx[2];
                hi = hi < qw ? hi : qw;
                for (int64_t v = 0; v < qh; ++v, dst += qw) {
                    const int64_t py = gy[2] * (r0 + v) + ry - gy[3];
                    if (py < 0 || py >= gy[4] || lo >= hi) { memset(dst, 0, sizeof(float) * qw); continue; }
                    const float *src = x + ch * cs + py * gy[5] + first * gx[5];
                    memset(dst, 0, sizeof(float) * lo);
                    if (gx[2] * gx[5] == 1) memcpy(dst + lo, src + lo, sizeof(float) * (hi - lo));
                    else for (int64_t u = lo, step = gx[2] * gx[5]; u < hi; ++u) dst[u] = src[u * step];
                    memset(dst + hi, 0, sizeof(float) * (qw - hi));
                }
            }
        }
    memset(xq + planes, 0, sizeof(float) * (room - planes));
    for (int64_t ch = 0, p = 0; ch < channels; ++ch)
        for (int64_t i = 0; i < gy[0]; ++i)
            for (int64_t j = 0; j < gx[0]; ++j, ++p) {
                const int64_t dy = gy[1] * i, dx = gx[1] * j;
                off[p] = ((ch * ny + phase_y[dy % gy[2]]) * nx + phase_x[dx % gx[2]]) * plane + dy / gy[2] * qw + dx / gx[2];
            }
    /* slices of k whose input rows (for a chunk of columns) fit in L1: whole channels' windows */
    const int64_t window = gy[0] * gx[0], chunk_rows = LC_CONV_NC / qw + 2 + gy[8];
    int64_t per_slice = LC_CONV_L1 / ((int64_t)sizeof(float) * ny * nx * chunk_rows * qw) * window;
    per_slice = per_slice < window ? window : per_slice > LC_KC ? LC_KC : per_slice;
    const int64_t slices = (k + per_slice - 1) / per_slice, kc_even = (k + slices - 1) / slices;
    /* a few strips of columns at a time: the input rows they read stay in L1 across A's tiles */
    for (int64_t jc = 0; jc < columns; jc += LC_CONV_NC) {
        const int64_t jend = jc + LC_CONV_NC < columns ? jc + LC_CONV_NC : columns;
        for (int64_t pc = 0; pc < k; pc += kc_even) {
            const int64_t kc = k - pc < kc_even ? k - pc : kc_even;
            for (int64_t i0 = 0; i0 < m; i0 += LC_CMR)
                for (int64_t j0 = jc; j0 < jend; j0 += LC_CNR)
                    lc_micro_rows(kc, packed + i0 * k + pc * LC_CMR, xq + j0, off + pc, sum + i0 * LC_CONV_NC + j0 - jc, pc > 0,
                                  jend - j0);
        }
        for (int64_t j = jc; j < jend;) {  /* the chunk's outputs: runs of columns within one output row */
            const int64_t x = j % qw;
            if (x >= ow) { j += qw - x; continue; }
            const int64_t run = ow - x < jend - j ? ow - x : jend - j;
            for (int64_t i = 0; i < m; ++i)
                memcpy(c + i * ldc + (r0 + j / qw) * ow + x, sum + i * LC_CONV_NC + j - jc, sizeof(float) * run);
            j += run;
        }
    }
}
"""
