// Paged decode attention for the CPU: one query token per sequence, read straight out of the
// paged KV cache through the block table (no gathered copy). Queries and outputs are float32,
// bfloat16 or float16; the cache is in the query's dtype, or quantized (int8 / fp8 e4m3 codes
// with one float32 scale per token and KV head, as paged_llm/quant/kv_cache.py stores them).
//
// Registered as torch.ops.paged_llm.paged_decode_cpu; built on first use by
// paged_llm/ops/paged_attention/cpu_native.py (torch.utils.cpp_extension, -O3 -march=native).
// The readable reference it is tested against is paged_llm/ops/paged_attention/reference.py.
//
// Shapes: out, query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables [B, max_blocks] int32; seq_lens [B] int32; k_scale, v_scale (quantized cache
// only) [num_blocks, block_size, Hkv] float32. sliding_window > 0 limits each query to its last
// sliding_window positions (itself included); 0 means the whole context.
//
// Work split: one sequence per task (a slice of its KV heads when there are fewer sequences
// than threads), handed out dynamically since sequences differ in length. A task walks its
// blocks in address order, all its KV heads at once: each block of block_size * Hkv * D
// contiguous values is read once for K and once for V, and the rows a few tokens ahead are
// requested early (kPrefetchTokens), across block jumps. Scores live in a per-thread
// [heads, seq_len] float buffer (two-pass softmax: max, then exp and sum); the output
// accumulates in float32. A vector's scale factors out of its dot product (K) and its softmax
// weight (V), so codes are read as is.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
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

// Per-thread buffers, reused across the tasks a thread handles (nh: the task's query heads).
struct Scratch {
  std::vector<float> scores;   // [nh, seq_len]
  std::vector<float> acc;      // [nh, D]
  std::vector<float> q;        // [nh, D]: the scaled query in float32
  std::vector<float> inv_sum;  // [nh]
};

// What every sequence of one call shares.
template <typename TC>
struct Cache {
  const TC* k;            // [num_blocks, block_size, Hkv, D]
  const TC* v;            //
  const float* k_scale;   // [num_blocks, block_size, Hkv], or nullptr: not quantized
  const float* v_scale;   //
  int64_t block_size, hkv, d;
};

// Rows this many tokens ahead are requested into L2 while the current row is computed on.
// Blocks sit anywhere in the pool, so the hardware prefetcher cannot run ahead across them,
// and the core's out-of-order window covers about one row. Measured with
// experiments/cpu_attention (64 sequences of 1024 tokens): 1.25x on one thread, 1.15x on
// two, 2x with blocks of one token. Requests into L1 instead fill its few miss buffers and
// were slower than none.
constexpr int64_t kPrefetchTokens = 4;

template <typename TC>
inline void prefetch_to_l2(const TC* row, int64_t count) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < count * static_cast<int64_t>(sizeof(TC)); off += 64)
    __builtin_prefetch(p + off, /*rw=*/0, /*locality=*/1);
}

// fn(i, token (first + i)'s [Hkv, D] row of ``pool``, its [Hkv] scales or nullptr) for every
// token of a sequence from ``first`` on, in order: block by block, each block's rows in address
// order. Only KV heads [kh0, kh1) are prefetched: those are the ones the caller reads.
template <typename TC, typename Fn>
inline void for_each_token(const TC* pool, const float* scales, const Cache<TC>& cache,
                           const int32_t* blocks, int64_t first, int64_t seq_len, int64_t kh0,
                           int64_t kh1, Fn fn) {
  const int64_t row = cache.hkv * cache.d;  // one token's values
  const int64_t bs = cache.block_size;
  auto slot_of = [&](int64_t t) { return blocks[t / bs] * bs + t % bs; };  // in the pool
  for (int64_t t = first; t < seq_len; ++t) {
    if (t + kPrefetchTokens < seq_len)
      prefetch_to_l2(pool + slot_of(t + kPrefetchTokens) * row + kh0 * cache.d,
                     (kh1 - kh0) * cache.d);
    const int64_t slot = slot_of(t);
    fn(t - first, pool + slot * row, scales ? scales + slot * cache.hkv : nullptr);
  }
}

// Attention of one sequence's query heads that read KV heads [kh0, kh1).
template <typename TQ, typename TC>
void decode_one_sequence(TQ* out,                // [Hq, D]: this sequence's output
                         const TQ* query,        // [Hq, D]
                         const Cache<TC>& cache,
                         const int32_t* blocks,  // this sequence's block table
                         int64_t seq_len, int64_t window, int64_t hq, int64_t kh0, int64_t kh1,
                         float scale, Scratch& scratch) {
  const int64_t d = cache.d;
  const int64_t group = hq / cache.hkv;
  const int64_t h0 = kh0 * group, nh = (kh1 - kh0) * group;  // query heads [h0, h0 + nh)
  out += h0 * d;
  query += h0 * d;
  if (seq_len <= 0) {  // nothing to attend to (never a real decode): zeros, not NaN
    std::fill(out, out + nh * d, static_cast<TQ>(0.f));
    return;
  }
  // The token sees positions [first, seq_len): n of them. Scores index them from first.
  const int64_t first = window > 0 ? std::max<int64_t>(0, seq_len - window) : 0;
  const int64_t n = seq_len - first;
  // Buffers index the query heads from h0: row i is query head h0 + i.
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  std::vector<float>& q = scratch.q;
  std::vector<float>& inv_sum = scratch.inv_sum;
  if (scores.size() < static_cast<size_t>(nh * n)) scores.resize(nh * n);
  acc.assign(nh * d, 0.f);
  q.resize(nh * d);
  inv_sum.resize(nh);
  // The query, scaled once, in float32: [nh, D].
  for (int64_t i = 0; i < nh * d; ++i) q[i] = to_float(query[i]) * scale;

  // Pass 1: scores[i, t] = q[i] . k[first + t, (h0 + i) / group] (times the vector's scale).
  for_each_token(cache.k, cache.k_scale, cache, blocks, first, seq_len, kh0, kh1,
                 [&](int64_t t, const TC* k, const float* k_scale) {
                   for (int64_t i = 0; i < nh; ++i) {
                     const int64_t kh = (h0 + i) / group;
                     const float s = dot(&q[i * d], k + kh * d, d);
                     scores[i * n + t] = k_scale ? s * k_scale[kh] : s;
                   }
                 });
  // Softmax over t for each query head, in place; keep 1 / sum for the end.
  for (int64_t i = 0; i < nh; ++i) {
    float* s = &scores[i * n];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    inv_sum[i] = 1.f / sum;
  }
  // Pass 2: acc[i] += p[i, t] * v[first + t, (h0 + i) / group] (times the vector's scale).
  for_each_token(cache.v, cache.v_scale, cache, blocks, first, seq_len, kh0, kh1,
                 [&](int64_t t, const TC* v, const float* v_scale) {
                   for (int64_t i = 0; i < nh; ++i) {
                     const int64_t kh = (h0 + i) / group;
                     const float p = scores[i * n + t];
                     axpy(&acc[i * d], v_scale ? p * v_scale[kh] : p, v + kh * d, d);
                   }
                 });
  for (int64_t i = 0; i < nh; ++i)
    for (int64_t j = 0; j < d; ++j)
      out[i * d + j] = static_cast<TQ>(acc[i * d + j] * inv_sum[i]);
}

template <typename TQ, typename TC>
void decode_batch(at::Tensor& out, const at::Tensor& query, const Cache<TC>& cache,
                  const int32_t* tables, int64_t table_stride, const int32_t* lens, float scale,
                  int64_t window) {
  const int64_t batch = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t threads = at::get_num_threads();
  // A task is one sequence, or with fewer sequences than threads a slice of its KV heads, so
  // that a lone long sequence still uses every thread. Each head's result is the same either
  // way: the split changes who computes it, not how.
  const int64_t wanted = std::min(cache.hkv, std::max<int64_t>(1, (threads + batch - 1) / batch));
  const int64_t heads_per_part = (cache.hkv + wanted - 1) / wanted;
  const int64_t parts = (cache.hkv + heads_per_part - 1) / heads_per_part;  // none left empty
  const int64_t tasks = batch * parts;
  const TQ* q = query.data_ptr<TQ>();
  TQ* o = out.data_ptr<TQ>();
  std::atomic<int64_t> next{0};
  // One worker per thread; each pulls tasks from a shared counter until none are left.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t b = task / parts, kh0 = (task % parts) * heads_per_part;
      const int64_t kh1 = std::min(cache.hkv, kh0 + heads_per_part);
      decode_one_sequence<TQ, TC>(o + b * hq * d, q + b * hq * d, cache,
                                  tables + b * table_stride, lens[b], window, hq, kh0, kh1,
                                  scale, scratch);
    }
  });
}

void check_scale(const std::optional<at::Tensor>& s, const at::Tensor& cache, const char* name) {
  TORCH_CHECK(s.has_value(), "a quantized cache needs ", name);
  TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                  s->size(0) == cache.size(0) && s->size(1) == cache.size(1) &&
                  s->size(2) == cache.size(2),
              name, " must be a contiguous float32 [num_blocks, block_size, Hkv] tensor");
}

void paged_decode_cpu(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                      const at::Tensor& seq_lens, double scale,
                      const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "query, out and caches must be contiguous");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "out must share query's dtype, and v_cache k_cache's");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(sliding_window >= 0, "sliding_window must be >= 0 (0: no window)");
  const int64_t batch = query.size(0), hq = query.size(1), d = query.size(2);
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "head_dim or head counts do not match");
  TORCH_CHECK(block_tables.size(0) >= batch && seq_lens.size(0) >= batch,
              "block_tables / seq_lens have fewer rows than the batch");
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || cache_type == query.scalar_type(),
              "the cache must be in the query's dtype, int8 or float8_e4m3fn");
  if (quantized) {
    check_scale(k_scale, k_cache, "k_scale");
    check_scale(v_scale, v_cache, "v_scale");
  }
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int32_t* len_ptr = lens.data_ptr<int32_t>();
  const int64_t stride = tables.size(1);
  const float qk_scale = static_cast<float>(scale);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode",
                                  [&] {
    auto run = [&](auto code) {  // code: a value of the cache's element type
      using TC = decltype(code);
      const Cache<TC> cache{k_cache.data_ptr<TC>(),
                            v_cache.data_ptr<TC>(),
                            quantized ? k_scale->data_ptr<float>() : nullptr,
                            quantized ? v_scale->data_ptr<float>() : nullptr,
                            k_cache.size(1),
                            hkv,
                            d};
      decode_batch<scalar_t, TC>(out, query, cache, table_ptr, stride, len_ptr, qk_scale,
                                 sliding_window);
    };
    if (cache_type == at::kChar)
      run(int8_t{});
    else if (cache_type == at::kFloat8_e4m3fn)
      run(c10::Float8_e4m3fn{});
    else
      run(scalar_t{});
  });
}

}  // namespace

TORCH_LIBRARY(paged_llm, m) {
  m.def(
      "paged_decode_cpu(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_scale=None, "
      "Tensor? v_scale=None, int sliding_window=0) -> ()");
}

TORCH_LIBRARY_IMPL(paged_llm, CPU, m) { m.impl("paged_decode_cpu", &paged_decode_cpu); }
