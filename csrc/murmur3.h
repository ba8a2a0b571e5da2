/* MurmurHash3_x64_128, first 64-bit word only (routing contract v1, key()).
 *
 * Ported from Austin Appleby's public-domain MurmurHash3.cpp (the code mmh3 wraps), reduced
 * to the h1 output. Reads the input as little-endian 64-bit blocks, exactly as mmh3 does on
 * little-endian machines; on a big-endian machine the loads below would need a byte swap.
 */
#ifndef PREFIX_SIDECAR_MURMUR3_H
#define PREFIX_SIDECAR_MURMUR3_H

#include <stdint.h>
#include <string.h>

static inline uint64_t ps_rotl64(uint64_t x, int8_t r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t ps_fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

static uint64_t ps_murmur3_x64_128_h1(const void *key, size_t len, uint32_t seed) {
    const uint8_t *data = (const uint8_t *)key;
    const size_t nblocks = len / 16;
    uint64_t h1 = seed, h2 = seed;
    const uint64_t c1 = 0x87c37b91114253d5ULL, c2 = 0x4cf5ad432745937fULL;
    size_t i;
    for (i = 0; i < nblocks; i++) {
        uint64_t k1, k2;
        memcpy(&k1, data + i * 16, 8);
        memcpy(&k2, data + i * 16 + 8, 8);
        k1 *= c1; k1 = ps_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
        h1 = ps_rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729;
        k2 *= c2; k2 = ps_rotl64(k2, 33); k2 *= c1; h2 ^= k2;
        h2 = ps_rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5;
    }
    const uint8_t *tail = data + nblocks * 16;
    uint64_t k1 = 0, k2 = 0;
    switch (len & 15) {
    case 15: k2 ^= ((uint64_t)tail[14]) << 48; /* fall through */
    case 14: k2 ^= ((uint64_t)tail[13]) << 40; /* fall through */
    case 13: k2 ^= ((uint64_t)tail[12]) << 32; /* fall through */
    case 12: k2 ^= ((uint64_t)tail[11]) << 24; /* fall through */
    case 11: k2 ^= ((uint64_t)tail[10]) << 16; /* fall through */
    case 10: k2 ^= ((uint64_t)tail[9]) << 8;   /* fall through */
    case 9:  k2 ^= ((uint64_t)tail[8]);
             k2 *= c2; k2 = ps_rotl64(k2, 33); k2 *= c1; h2 ^= k2; /* fall through */
    case 8:  k1 ^= ((uint64_t)tail[7]) << 56; /* fall through */
    case 7:  k1 ^= ((uint64_t)tail[6]) << 48; /* fall through */
    case 6:  k1 ^= ((uint64_t)tail[5]) << 40; /* fall through */
    case 5:  k1 ^= ((uint64_t)tail[4]) << 32; /* fall through */
    case 4:  k1 ^= ((uint64_t)tail[3]) << 24; /* fall through */
    case 3:  k1 ^= ((uint64_t)tail[2]) << 16; /* fall through */
    case 2:  k1 ^= ((uint64_t)tail[1]) << 8;  /* fall through */
    case 1:  k1 ^= ((uint64_t)tail[0]);
             k1 *= c1; k1 = ps_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
    }
    h1 ^= (uint64_t)len; h2 ^= (uint64_t)len;
    h1 += h2; h2 += h1;
    h1 = ps_fmix64(h1); h2 = ps_fmix64(h2);
    h1 += h2;
    return h1;
}

#endif
