/* Philox4x32-10 noise for the CPU: the C fast path of distzo.zo.philox.
 *
 * Element e of a bucket takes lane j of counter t*512 + r%512, where t = e / (512*L),
 * r = e % (512*L), j = r / 512, and L lanes per counter: 8 lanes of 16 bits (z) or 4
 * of 32 bits (uniform draws). See distzo/zo/philox.py, which defines the same function
 * in Python (the reference) and torch (any device); the tests hold all three equal.
 *
 * Only integer arithmetic and table lookups: the outputs are the same bits on every
 * machine. A tile's 512 counters are computed together, structure of arrays, so the
 * compiler vectorises the 32x32->64-bit multiplies.
 */
#include <stdint.h>
#include <string.h>

#define M0 0xD2511F53u
#define M1 0xCD9E8D57u
#define W0 0x9E3779B9u
#define W1 0xBB67AE85u
#define TILE_BLOCKS 512

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* words[w][b]: word w of counter first + b, for the tile's 512 counters */
VECTOR_CLONES static void philox_tile(uint64_t first, uint32_t k0, uint32_t k1, uint32_t words[4][TILE_BLOCKS]) {
    uint32_t c0[TILE_BLOCKS], c1[TILE_BLOCKS], c2[TILE_BLOCKS], c3[TILE_BLOCKS];
    for (int b = 0; b < TILE_BLOCKS; b++) {
        uint64_t counter = first + (uint64_t)b;
        c0[b] = (uint32_t)counter;
        c1[b] = (uint32_t)(counter >> 32);
        c2[b] = 0;
        c3[b] = 0;
    }
    for (int round = 0; round < 10; round++) {
        for (int b = 0; b < TILE_BLOCKS; b++) {
            uint64_t p0 = (uint64_t)M0 * c0[b];
            uint64_t p1 = (uint64_t)M1 * c2[b];
            uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[b] ^ k0;
            uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[b] ^ k1;
            c1[b] = (uint32_t)p1;
            c3[b] = (uint32_t)p0;
            c0[b] = n0;
            c2[b] = n2;
        }
        k0 += W0;
        k1 += W1;
    }
    memcpy(words[0], c0, sizeof(c0));
    memcpy(words[1], c1, sizeof(c1));
    memcpy(words[2], c2, sizeof(c2));
    memcpy(words[3], c3, sizeof(c3));
}

/* kind 0: table[lane16] (Gaussian), 1: +-1 from the lane's top bit (Rademacher),
 * 2: (word32 >> 8) * 2^-24 (uniform in [0, 1)) */
void distzo_philox_fill(float *out, int64_t start, int64_t count, uint32_t k0, uint32_t k1, int kind,
                        const float *table) {
    uint32_t words[4][TILE_BLOCKS];
    const int lanes = kind == 2 ? 4 : 8;
    const int64_t tile = (int64_t)TILE_BLOCKS * lanes;
    const int64_t stop = start + count;
    for (int64_t t = start / tile; t * tile < stop; t++) {
        philox_tile((uint64_t)t * TILE_BLOCKS, k0, k1, words);
        for (int lane = 0; lane < lanes; lane++) {
            int64_t base = t * tile + (int64_t)lane * TILE_BLOCKS;
            int64_t lo = base > start ? base : start, hi = base + TILE_BLOCKS < stop ? base + TILE_BLOCKS : stop;
            if (lo >= hi) continue;
            float *dst = out + (lo - start);
            if (kind == 2) {
                const uint32_t *w = words[lane] + (lo - base);
                for (int64_t i = 0; i < hi - lo; i++) dst[i] = (float)(w[i] >> 8) * (1.0f / 16777216.0f);
            } else {
                const uint32_t *w = words[lane / 2] + (lo - base);
                const int shift = 16 * (lane % 2);
                if (kind == 0) {
                    for (int64_t i = 0; i < hi - lo; i++) dst[i] = table[(w[i] >> shift) & 0xFFFFu];
                } else {
                    for (int64_t i = 0; i < hi - lo; i++) dst[i] = ((w[i] >> shift) & 0x8000u) ? 1.0f : -1.0f;
                }
            }
        }
    }
}
