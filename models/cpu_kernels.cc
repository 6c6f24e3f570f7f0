// Skinny f32 matmuls for XLA:CPU (an XLA FFI custom call), used by the decode and verify
// steps: y[M,N] = x[M,K] @ w[K,N] ("nn") and y[M,V] = x[M,D] @ e[V,D]^T ("nt", tied
// embeddings), for few rows M (1 greedy token, 2..16 for a verify block).
//
// Why: XLA:CPU hands a dot with M >= 2 to a general GEMM whose cost jumps by ~30% from
// M = 1 to M = 2 and ~60% at M = 4 on a 2-core x86, although reading the weights (the real
// cost at small M) is the same. Here every weight vector loaded from memory is used for all
// M rows at once, so a step costs about one pass over the weights for M up to ~8.
//
// Numerics: each output row is accumulated in the same order whatever M is (sequential
// over k with FMAs; the same horizontal reduction for "nt"), so a row's result does not
// depend on how many rows share the call: a verify block and a greedy step compute
// bit-identical logits for the same row.
//
// Threads: column tiles are claimed from an atomic counter by the calling thread and one
// task per extra worker of XLA's intra-op pool (the FFI ThreadPool); the caller waits for
// tiles in progress only, so a pool that is busy elsewhere just leaves the work to it.
//
// Built at first use by models/cpu_kernels.py with the host compiler (-O3 -march=native);
// AVX-512 or AVX2+FMA.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if defined(__AVX512F__)
constexpr int VW = 16;
using vec = __m512;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
using vec = __m256;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
#error "cpu_kernels.cc needs AVX2+FMA or AVX-512 (the Python side falls back to XLA's dot)"
#endif

constexpr int MR = 8;        // rows of x per register block (8 x 3 accumulators)
static_assert(MR == 8, "for_row_blocks spells out remainders of 1..7 rows");
constexpr int PREFETCH = 16;  // rows of w ahead ("nn")

// ---------------------------------------------------------------- nn: x[M,K] @ w[K,N]
// One column tile: NV vectors wide, all M rows (in blocks of MR; later blocks find the
// tile's weights in L2).
template <int NV, int R>
static void nn_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0) {
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = vzero();
  const float* wk = w + n0;
  for (int64_t k = 0; k < K; ++k, wk += N) {
    if (k + PREFETCH < K)
      for (int j = 0; j < NV * VW; j += 16) _mm_prefetch((const char*)(wk + PREFETCH * N + j), _MM_HINT_T0);
    vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = vload(wk + j * VW);
    for (int r = 0; r < R; ++r) {
      vec xb = vset1(x[r * K + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = vfma(xb, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) vstore(y + r * N + n0 + j * VW, acc[r][j]);
}

// Calls f(m, R) for the row blocks of M rows: full blocks of MR, then one of M % MR rows
// (R a compile-time constant, so each block size gets its own register allocation).
template <typename F>
static void for_row_blocks(int64_t M, const F& f) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) f(m, std::integral_constant<int, MR>{});
  switch (M - m) {
    case 1: f(m, std::integral_constant<int, 1>{}); break;
    case 2: f(m, std::integral_constant<int, 2>{}); break;
    case 3: f(m, std::integral_constant<int, 3>{}); break;
    case 4: f(m, std::integral_constant<int, 4>{}); break;
    case 5: f(m, std::integral_constant<int, 5>{}); break;
    case 6: f(m, std::integral_constant<int, 6>{}); break;
    case 7: f(m, std::integral_constant<int, 7>{}); break;
    default: break;
  }
}

template <int NV>
static void nn_tile(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  for_row_blocks(M, [&](int64_t m, auto R) { nn_block<NV, decltype(R)::value>(x + m * K, w, y + m * N, K, N, n0); });
}

// ---------------------------------------------------------------- nt: x[M,D] @ e[V,D]^T
template <int RV, int R>
static void nt_block(const float* x, const float* e, float* y, int64_t D, int64_t V, int64_t v0) {
  vec acc[R][RV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < RV; ++j) acc[r][j] = vzero();
  for (int64_t d = 0; d < D; d += VW) {
    vec ev[RV];
    for (int j = 0; j < RV; ++j) ev[j] = vload(e + (v0 + j) * D + d);
    for (int r = 0; r < R; ++r) {
      vec xv = vload(x + r * D + d);
      for (int j = 0; j < RV; ++j) acc[r][j] = vfma(xv, ev[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < RV; ++j) y[r * V + v0 + j] = vsum(acc[r][j]);
}

template <int RV>
static void nt_tile(const float* x, const float* e, float* y, int64_t M, int64_t D, int64_t V, int64_t v0) {
  for_row_blocks(M, [&](int64_t m, auto R) { nt_block<RV, decltype(R)::value>(x + m * D, e, y + m * V, D, V, v0); });
}

// ---------------------------------------------------------------- work sharing
struct Work {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_tiles = 0;
  int64_t chunk = 1;
};

template <typename F>
static void run_tiles(Work* s, const F& tile) {
  for (;;) {
    int64_t t0 = s->next.fetch_add(s->chunk, std::memory_order_relaxed);
    if (t0 >= s->n_tiles) return;
    int64_t t1 = std::min(t0 + s->chunk, s->n_tiles);
    for (int64_t t = t0; t < t1; ++t) tile(t);
    s->done.fetch_add(t1 - t0, std::memory_order_release);
  }
}

template <typename F>
static void parallel_tiles(ffi::ThreadPool& pool, int64_t n_tiles, const F& tile) {
  auto state = std::make_shared<Work>();
  state->n_tiles = n_tiles;
  int64_t workers = std::max<int64_t>(0, pool.num_threads() - 1);
  workers = std::min<int64_t>(workers, n_tiles - 1);
  state->chunk = std::max<int64_t>(1, n_tiles / (8 * (workers + 1)));
  // A helper that starts after the caller finished finds no tiles left: it only touches
  // `state` (kept alive by its own reference), never the buffers.
  for (int64_t i = 0; i < workers; ++i) pool.Schedule([state, tile]() { run_tiles(state.get(), tile); });
  run_tiles(state.get(), tile);
  while (state->done.load(std::memory_order_acquire) < n_tiles) _mm_pause();
}

// ---------------------------------------------------------------- FFI handlers
static ffi::Error MatmulNN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || wd[1] % VW)
    return ffi::Error::InvalidArgument("matmul_nn: needs x[M,K], w[K,N] with N % vector width == 0");
  const int64_t M = xd[0], K = xd[1], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  constexpr int64_t TW = 3 * VW;  // tile width
  const int64_t wide = N / TW, narrow = (N % TW) / VW;
  parallel_tiles(pool, wide + narrow, [=](int64_t t) {
    if (t < wide) nn_tile<3>(xp, wp, yp, M, K, N, t * TW);
    else nn_tile<1>(xp, wp, yp, M, K, N, wide * TW + (t - wide) * VW);
  });
  return ffi::Error::Success();
}

static ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e,
                           ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || xd[1] != ed[1] || ed[1] % VW)
    return ffi::Error::InvalidArgument("matmul_nt: needs x[M,D], e[V,D] with D % vector width == 0");
  const int64_t M = xd[0], D = xd[1], V = ed[0];
  const float* xp = x.typed_data();
  const float* ep = e.typed_data();
  float* yp = y->typed_data();
  constexpr int64_t RV = 3;        // rows of e per block
  constexpr int64_t TV = 16 * RV;  // rows of e per tile
  const int64_t full = V / TV, rest = V % TV;
  parallel_tiles(pool, full + (rest ? 1 : 0), [=](int64_t t) {
    const int64_t v0 = t * TV, v1 = std::min(V, v0 + TV);
    int64_t v = v0;
    for (; v + RV <= v1; v += RV) nt_tile<RV>(xp, ep, yp, M, D, V, v);
    for (; v < v1; ++v) nt_tile<1>(xp, ep, yp, M, D, V, v);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nn, MatmulNN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int lookahead_vector_width() { return VW; }
