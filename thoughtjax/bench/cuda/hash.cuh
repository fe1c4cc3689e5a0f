// Device helpers shared by the CUDA C comparators: the same counter-based hash, Gumbel noise and
// order key as thoughtjax/kernels/sample_stop.py, bit for bit. tests/bench/test_kernels.py builds
// this header for the host and checks it against the JAX functions.
#pragma once
__device__ unsigned fmix32(unsigned h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; return h ^ (h >> 16);
}
__device__ unsigned row_key(unsigned seed, unsigned step, unsigned row) {
  unsigned h = fmix32(seed ^ 0x243F6A88u);
  h = fmix32(h ^ (step * 0x9E3779B9u));
  return fmix32(h ^ (row * 0x85EBCA77u));
}
__device__ float gumbel(unsigned key, int v) {
  unsigned h = fmix32(key ^ ((unsigned)v * 0xC2B2AE3Du));
  h = fmix32(h + 0x27D4EB2Fu);
  float u = __fmul_rn(__fadd_rn((float)(int)(h >> 9), 0.5f), 1.1920928955078125e-07f);
  return -logf(-logf(u));
}
__device__ int order_key(float y) {
  int bits = __float_as_int(y);
  int key = bits < 0 ? (bits ^ 0x7FFFFFFF) : bits;
  return y == 0.0f ? 0 : key;
}
