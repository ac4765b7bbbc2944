// Paged decode attention for the CPU: one query token per sequence, read straight out of the
// paged KV cache through the block table (no gathered copy), for float32 / bfloat16 / float16.
//
// Registered as torch.ops.paged_llm.paged_decode_cpu; built on first use by
// paged_llm/ops/paged_attention/cpu_native.py (torch.utils.cpp_extension, -O3 -march=native).
// The readable reference it is tested against is paged_llm/ops/paged_attention/reference.py.
//
// Shapes: out, query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables [B, max_blocks] int32; seq_lens [B] int32 (host tensor or not, read once).
//
// Work split: one sequence per task, handed out dynamically (sequences differ in length), so a
// task walks its blocks in address order, every KV head at once: each block of
// block_size * Hkv * D contiguous values is read once for K and once for V, which keeps the
// hardware prefetcher streaming. Scores live in a per-thread [Hq, seq_len] float buffer
// (two-pass softmax: max, then exp and sum); the output accumulates in float32.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Dot product of a float query row with one cached row of D values.
template <typename T>
inline float dot(const float* __restrict q, const T* __restrict k, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += q[i] * to_float(k[i]);
  return acc;
}

// acc += p * v over D values.
template <typename T>
inline void axpy(float* __restrict acc, float p, const T* __restrict v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * to_float(v[i]);
}

// Per-thread buffers, reused across the sequences a thread handles.
struct Scratch {
  std::vector<float> scores;   // [Hq, seq_len]
  std::vector<float> acc;      // [Hq, D]
  std::vector<float> q;        // [Hq, D]: the scaled query in float32
  std::vector<float> inv_sum;  // [Hq]
};

template <typename T>
void decode_one_sequence(T* out,                 // [Hq, D]
                         const T* query,         // [Hq, D]
                         const T* k_cache,       // [num_blocks, block_size, Hkv, D]
                         const T* v_cache,       //
                         const int32_t* blocks,  // this sequence's block table
                         int64_t seq_len, int64_t block_size, int64_t hq, int64_t hkv,
                         int64_t d, float scale,
                         Scratch& scratch) {
  const int64_t group = hq / hkv;
  const int64_t row = hkv * d;            // one token's values of one cache
  const int64_t block = block_size * row;  // one block of one cache
  if (seq_len <= 0) {  // nothing to attend to (never a real decode): zeros, not NaN
    std::fill(out, out + hq * d, static_cast<T>(0.f));
    return;
  }
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  std::vector<float>& q = scratch.q;
  std::vector<float>& inv_sum = scratch.inv_sum;
  if (scores.size() < static_cast<size_t>(hq * seq_len)) scores.resize(hq * seq_len);
  acc.assign(hq * d, 0.f);
  q.resize(hq * d);
  inv_sum.resize(hq);
  // The query, scaled once, in float32: [Hq, D].
  for (int64_t i = 0; i < hq * d; ++i) q[i] = to_float(query[i]) * scale;

  // Pass 1: scores[h, t] = q[h] . k[t, h / group], block by block.
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const T* kb = k_cache + static_cast<int64_t>(blocks[t0 / block_size]) * block;
    const int64_t n = std::min(block_size, seq_len - t0);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < hq; ++h)
        scores[h * seq_len + t0 + j] = dot(&q[h * d], kb + j * row + (h / group) * d, d);
    }
  }
  // Softmax over t for each query head, in place; keep 1 / sum for the end.
  for (int64_t h = 0; h < hq; ++h) {
    float* s = &scores[h * seq_len];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < seq_len; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[h] = 1.f / sum;
  }
  // Pass 2: acc[h] += p[h, t] * v[t, h / group], block by block.
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const T* vb = v_cache + static_cast<int64_t>(blocks[t0 / block_size]) * block;
    const int64_t n = std::min(block_size, seq_len - t0);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = 0; h < hq; ++h)
        axpy(&acc[h * d], scores[h * seq_len + t0 + j], vb + j * row + (h / group) * d, d);
    }
  }
  for (int64_t h = 0; h < hq; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] = static_cast<T>(acc[h * d + i] * inv_sum[h]);
}

void paged_decode_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "query, out and caches must be contiguous");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == query.scalar_type(),
              "query, out and caches must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  const int64_t batch = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) >= batch && seq_lens.size(0) >= batch,
              "block_tables / seq_lens have fewer rows than the batch");
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t table_stride = tables.size(1);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode",
                                  [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    std::atomic<int64_t> next{0};
    // One task per thread; each pulls sequences from a shared counter until none are left.
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t b = next++; b < batch; b = next++) {
        decode_one_sequence<scalar_t>(o + b * hq * d, q + b * hq * d, kc, vc,
                                      table_ptr + b * table_stride, len_ptr[b], block_size, hq,
                                      hkv, d, static_cast<float>(scale), scratch);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(paged_llm, m) {
  m.def(
      "paged_decode_cpu(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(paged_llm, CPU, m) { m.impl("paged_decode_cpu", &paged_decode_cpu); }
