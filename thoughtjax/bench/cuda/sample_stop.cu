// sample_stop_f32: fused logit bias, temperature, top-k, Gumbel-max sampling (or argmax) and the
// stop flag, one thread block per row; the contract of thoughtjax/kernels/sample_stop.py.
// __fmul_rn/__fadd_rn keep nvcc from contracting y = s * inv_t; y + g into an FMA that XLA does not do.
#include "hash.cuh"

#define THREADS 256

// Block-wide reductions; every thread gets the result.
__device__ int block_reduce_int(int x, int op, int* shared) {  // op 0 sum, 1 min, 2 max
  for (int o = 16; o > 0; o >>= 1) {
    int y = __shfl_down_sync(0xffffffffu, x, o);
    x = op == 0 ? x + y : (op == 1 ? min(x, y) : max(x, y));
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < THREADS / 32 ? shared[lane] : (op == 0 ? 0 : (op == 1 ? 0x7FFFFFFF : (int)0x80000000));
    for (int o = 16; o > 0; o >>= 1) {
      int y = __shfl_down_sync(0xffffffffu, x, o);
      x = op == 0 ? x + y : (op == 1 ? min(x, y) : max(x, y));
    }
    if (lane == 0) shared[0] = x;
  }
  __syncthreads();
  return shared[0];
}
__device__ void better(float* v, int* i, float v2, int i2) {
  if (v2 > *v || (v2 == *v && i2 < *i)) { *v = v2; *i = i2; }
}
__device__ int block_argmax(float v, int i, float* shared_v, int* shared_i) {
  for (int o = 16; o > 0; o >>= 1)
    better(&v, &i, __shfl_down_sync(0xffffffffu, v, o), __shfl_down_sync(0xffffffffu, i, o));
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { shared_v[warp] = v; shared_i[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? shared_v[lane] : -__int_as_float(0x7f800000);
    i = lane < THREADS / 32 ? shared_i[lane] : 0x7FFFFFFF;
    for (int o = 16; o > 0; o >>= 1)
      better(&v, &i, __shfl_down_sync(0xffffffffu, v, o), __shfl_down_sync(0xffffffffu, i, o));
    if (lane == 0) shared_i[0] = i;
  }
  __syncthreads();
  return shared_i[0];
}

extern "C" __global__ void __launch_bounds__(THREADS) sample_stop_f32(
    const float* logits, const float* bias, int has_bias, const float* inv_t,
    const int* greedy, const int* top_k, const unsigned* seed, int step,
    const int* stop_ids, int num_stop, int vocab, int* token_out, int* stop_out) {
  __shared__ int shared[32];
  __shared__ float shared_v[32];
  int row = blockIdx.x;
  const float* x = logits + (long long)row * vocab;
  const float* bb = bias + (long long)row * vocab;
  float scale = inv_t[row];
  int k = top_k[row];
  #define Y(v) __fmul_rn(has_bias ? __fadd_rn(x[v], bb[v]) : x[v], scale)
  int threshold = (int)0x80000000;
  if (k > 0) {
    int lo = 0x7FFFFFFF, hi = (int)0x80000000;
    for (int v = threadIdx.x; v < vocab; v += THREADS) {
      int key = order_key(Y(v));
      lo = min(lo, key); hi = max(hi, key);
    }
    lo = block_reduce_int(lo, 1, shared);
    hi = block_reduce_int(hi, 2, shared) + 1;
    while (true) {
      int mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1);
      if (mid <= lo) break;
      int count = 0;
      for (int v = threadIdx.x; v < vocab; v += THREADS) count += order_key(Y(v)) >= mid;
      count = block_reduce_int(count, 0, shared);
      if (count >= k) lo = mid; else hi = mid;
    }
    threshold = lo;
  }
  unsigned key = row_key(seed[row], (unsigned)step, (unsigned)row);
  bool noisy = greedy[row] == 0;
  float best = -__int_as_float(0x7f800000);
  int best_i = 0x7FFFFFFF;
  for (int v = threadIdx.x; v < vocab; v += THREADS) {
    float y = Y(v);
    float score = order_key(y) >= threshold ? y : -__int_as_float(0x7f800000);
    if (noisy) score = __fadd_rn(score, gumbel(key, v));
    better(&best, &best_i, score, v);
  }
  int token = block_argmax(best, best_i, shared_v, shared);
  int hit = 0;
  for (int j = threadIdx.x; j < num_stop; j += THREADS)
    hit |= stop_ids[(long long)row * num_stop + j] == token;
  hit = block_reduce_int(hit, 2, shared);
  if (threadIdx.x == 0) { token_out[row] = token; stop_out[row] = hit; }
}
