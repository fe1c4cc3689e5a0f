// template_embed_{4,2}byte: prefix rows, gathered user-token rows and suffix rows written in one pass,
// one thread per output element; the contract of thoughtjax/kernels/template_embed.py.
#define TEMPLATE_EMBED(NAME, T)                                                    \
extern "C" __global__ void NAME(                                                   \
    const T* prefix, int prefix_len, const T* suffix, int suffix_len,              \
    const T* table, int vocab, const int* ids, int max_user, const int* lengths,   \
    int total_len, int dim, int left_pad, T* out, long long total) {               \
  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;                  \
  if (i >= total) return;                                                          \
  int d = (int)(i % dim);                                                          \
  long long bt = i / dim;                                                          \
  int t = (int)(bt % total_len), b = (int)(bt / total_len);                        \
  int len = min(max(lengths[b], 0), max_user);                                     \
  int start = left_pad ? total_len - (prefix_len + len + suffix_len) : 0;          \
  int p = t - start, q = p - prefix_len, r = q - len;                              \
  T value = (T)0;                                                                  \
  if (p >= 0 && p < prefix_len) value = prefix[(long long)p * dim + d];            \
  else if (q >= 0 && q < len) {                                                    \
    int id = min(max(ids[(long long)b * max_user + q], 0), vocab - 1);             \
    value = table[(long long)id * dim + d];                                        \
  } else if (r >= 0 && r < suffix_len) value = suffix[(long long)r * dim + d];     \
  out[i] = value;                                                                  \
}
TEMPLATE_EMBED(template_embed_4byte, float)
TEMPLATE_EMBED(template_embed_2byte, unsigned short)
