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
"""

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
    if (mr == LC_MR && nr == LC_NR) {
        for (int i = 0; i < LC_MR; ++i)
            for (int j = 0; j < LC_NR / LC_VW; ++j) {
                lc_vecu *dst = (lc_vecu *)(c + i * ldc + LC_VW * j);
                *dst = add ? *dst + acc[i][j] : acc[i][j];
            }
        return;
    }
    float tile[LC_MR][LC_NR] __attribute__((aligned(64)));
    for (int i = 0; i < LC_MR; ++i)
        for (int j = 0; j < LC_NR / LC_VW; ++j) *(lc_vec *)&tile[i][LC_VW * j] = acc[i][j];
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) c[i * ldc + j] = add ? c[i * ldc + j] + tile[i][j] : tile[i][j];
}

/* c[mr x nr] (row stride ldc) = (or +=) the packed a panel (kc x LC_MR) times the packed b panel (kc x LC_NR) */
static inline void lc_micro(int64_t kc, const float *restrict a, const float *restrict b, float *restrict c,
                            int64_t ldc, int add, int64_t mr, int64_t nr) {
    lc_vec acc[LC_MR][LC_NR / LC_VW];
    for (int i = 0; i < LC_MR; ++i)
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    for (int64_t p = 0; p < kc; ++p) {
        lc_vec bv[LC_NR / LC_VW];
        for (int j = 0; j < LC_NR / LC_VW; ++j) bv[j] = *(const lc_vec *)(b + p * LC_NR + LC_VW * j);
        for (int i = 0; i < LC_MR; ++i) {
            const float ai = a[p * LC_MR + i];
            for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] += ai * bv[j];
        }
    }
    lc_store_tile(acc, c, ldc, add, mr, nr);
}

/* c[mr x nr] (row stride ldc) = (or +=) A's rows (i, p) at a[i * ars + p * acs] times B's rows p at
   b + p * ldb, LC_NR columns each, read in place: no packing */
static inline void lc_micro_direct(int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b,
                                   int64_t ldb, float *restrict c, int64_t ldc, int add, int64_t mr, int64_t nr) {
    lc_vec acc[LC_MR][LC_NR / LC_VW];
    const float *row[LC_MR];
    for (int i = 0; i < LC_MR; ++i) {
        row[i] = a + (i < mr ? i : mr - 1) * ars;  /* rows past mr repeat the last: read, not stored */
        for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] = (lc_vec){0};
    }
    for (int64_t p = 0; p < kc; ++p) {
        lc_vec bv[LC_NR / LC_VW];
        for (int j = 0; j < LC_NR / LC_VW; ++j) bv[j] = *(const lc_vecu *)(b + p * ldb + LC_VW * j);
        for (int i = 0; i < LC_MR; ++i) {
            const float ai = row[i][p * acs];
            for (int j = 0; j < LC_NR / LC_VW; ++j) acc[i][j] += ai * bv[j];
        }
    }
    lc_store_tile(acc, c, ldc, add, mr, nr);
}

/* A's (i, p) at a[i * ars + p * acs], for i < mc, p < kc, into MR-tall panels */
static void lc_pack_a(int64_t mc, int64_t kc, const float *a, int64_t ars, int64_t acs, float *restrict out) {
    for (int64_t i0 = 0; i0 < mc; i0 += LC_MR, out += kc * LC_MR) {
        const int64_t mr = mc - i0 < LC_MR ? mc - i0 : LC_MR;
        for (int64_t p = 0; p < kc; ++p) {
            for (int64_t i = 0; i < mr; ++i) out[p * LC_MR + i] = a[(i0 + i) * ars + p * acs];
            for (int64_t i = mr; i < LC_MR; ++i) out[p * LC_MR + i] = 0.0f;
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
                lc_pack_a(mc, kc, a + ic * ars + pc * acs, ars, acs, packed_a);
                for (int64_t jr = 0; jr < nc; jr += LC_NR)
                    for (int64_t ir = 0; ir < mc; ir += LC_MR)
                        lc_micro(kc, packed_a + ir * kc, packed_b + jr * kc, c + (ic + ir) * ldc + jc + jr, ldc, pc > 0,
                                 mc - ir < LC_MR ? mc - ir : LC_MR, nc - jr < LC_NR ? nc - jr : LC_NR);
            }
        }
    }
}
"""
