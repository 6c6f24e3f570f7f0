// CPU kernels for the decode and verify steps (XLA FFI custom calls), f32, for few rows M
// (1 greedy token, 2..16 for a verify block): y[M,N] = x[M,K] @ w[K,N] ("nn"; also with w
// packed in column tiles, for any M), y[M,V] = x[M,D] @ e[V,D]^T ("nt", tied embeddings),
// one layer's attention of the new tokens over the KV cache, argmax over logits, and the
// exact KNN search's shortlist (the kp smallest |x|^2 - 2 h.x over f16/f32 keys).
//
// Why: XLA:CPU hands a dot with M >= 2 to a general GEMM whose cost jumps by ~30% from
// M = 1 to M = 2 and ~60% at M = 4 on a 2-core x86, although reading the weights (the real
// cost at small M) is the same. Here every weight vector loaded from memory is used for all
// M rows at once, so a step costs about one pass over the weights for M up to ~8. XLA's
// attention at these sizes is ~12 small ops whose fixed costs dominate; here it is one.
//
// Numerics: each output row is accumulated in the same order whatever M is (sequential
// over k with FMAs in "nn"; the same FMAs and reduction tree for every product in "nt"
// and the attention scores), so a row's result does not depend on how many rows share
// the call: a verify block and a greedy step compute bit-identical logits for the same row.
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
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
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
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vscale2(vec p, vec n) { return _mm512_scalef_ps(p, n); }
static inline vec vzero_below(vec v, vec x, vec lo) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), v); }
// Horizontal sums of VW vectors at once: lane L of vreduce(acc) is the sum of the vector
// in slot vslot(L) (a 4x4 transpose of the slot index: the shuffle network below leaves
// lane 4i + c holding slot 4c + i). Four levels of two shuffles and an add.
constexpr int vslot(int lane) { return 4 * (lane % 4) + lane / 4; }  // an involution
static inline vec vreduce(const vec* a) {
  vec w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: blocks [p0+p2, p1+p3, q0+q2, q1+q3]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit blocks: one slot per block
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // pairs of lanes
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
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
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vround(vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vec vscale2(vec p, vec n) {  // p * 2^n for integral n in [-126, 127]
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline vec vzero_below(vec v, vec x, vec lo) { return _mm256_and_ps(v, _mm256_cmp_ps(x, lo, _CMP_GE_OQ)); }
// Horizontal sums of VW vectors at once: lane L of vreduce(acc) is the sum of acc[L].
constexpr int vslot(int lane) { return lane; }
static inline vec vreduce(const vec* a) {
  vec h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
  vec h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
  vec g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
#else
#error "cpu_kernels.cc needs AVX2+FMA or AVX-512 (the Python side falls back to XLA's dot)"
#endif

// exp(x) for x <= 0 (softmax after subtracting the row max), Cephes' expf polynomial:
// x = n ln2 + r, |r| <= ln2/2, e^r = 1 + r + r^2 P(r), times 2^n; x < -87 gives exactly 0,
// so a masked or negligible slot adds nothing to the sums (a window padded with masked
// slots gives bitwise the same row as a narrower one).
static inline vec vexp_neg(vec x) {
  const vec lo = vset1(-87.0f);
  vec xc = vmax(x, lo);
  vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  vec r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vzero_below(vscale2(p, n), x, lo);
}

// Weight vectors for "nn": f32, or bf16 (the top 16 bits of an f32, stored as uint16) widened
// to f32 in registers. A bf16 weight halves the bytes a step reads; the arithmetic stays f32
// (`cpu_kernels.pack(w, dtype=bfloat16)`: for draft models, whose rounding costs no exactness).
static inline vec wload(const float* p) { return vload(p); }
static inline vec wload(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#else
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
#endif
}

// Rows of x per register block: MR x 3 accumulators beside 3 weight vectors and a broadcast
// fit the register file (AVX-512: 8 x 3 + 3 + 1 of 32; AVX2: 4 x 3 + 3 + 1 of 16, where 8 x 3
// spilled: 8 rows took 61 ms of weight matmuls a SmolLM2 step against 48 ms in 4-row blocks
// on a 2-core AMD EPYC, bench/ceiling.py).
#if defined(__AVX512F__)
constexpr int MR = 8;
#else
constexpr int MR = 4;
#endif
constexpr int PREFETCH = 16;  // rows of w ahead ("nn")
constexpr int NV1 = 8;  // vectors per tile of a one-row product

// ---------------------------------------------------------------- nn: x[M,K] @ w[K,N]
// One column tile: NV vectors wide, R rows of x (ldx apart), the tile's first column of w
// at `w` (rows ldw apart), of y at `y` (rows ldy apart). Callers run all M rows in blocks
// of MR; later blocks find the tile's weights in L2. PF: prefetch rows of w PREFETCH
// ahead (a strided walk over row-major w needs it; packed tiles are one contiguous
// stream, which the hardware prefetcher follows better alone).
// first = false: carry on the sums already in y (a later slice of K, `nn_tile_large`).
template <int NV, int R, bool PF = true, typename WT = float>
static void nn_block(const float* x, int64_t ldx, const WT* w, int64_t ldw, float* y, int64_t ldy,
                     int64_t K, bool first = true) {
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = first ? vzero() : vload(y + r * ldy + j * VW);
  const WT* wk = w;
  for (int64_t k = 0; k < K; ++k, wk += ldw) {
    if (PF && k + PREFETCH < K)
      for (int j = 0; j < NV * VW; j += 16) _mm_prefetch((const char*)(wk + PREFETCH * ldw + j), _MM_HINT_T0);
    vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = wload(wk + j * VW);
    for (int r = 0; r < R; ++r) {
      vec xb = vset1(x[r * ldx + k]);
      for (int j = 0; j < NV; ++j) acc[r][j] = vfma(xb, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) vstore(y + r * ldy + j * VW, acc[r][j]);
}

// Calls f(m, R) for the row blocks of M rows: full blocks of MB, then one of M % MB rows
// (R a compile-time constant, so each block size gets its own register allocation).
template <int MB, typename F>
static void for_row_blocks(int64_t M, const F& f) {
  static_assert(MB <= 8, "the remainders spelled out below are 1..7 rows");
  int64_t m = 0;
  for (; m + MB <= M; m += MB) f(m, std::integral_constant<int, MB>{});
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

// Many rows (a prefill block): nn_block's product, cache-blocked. K is cut into slices of
// KC rows of w (a slice of a tile fits L1) and every row block runs over one slice before
// the next, carrying its sums through y: each output still gets the FMAs over k = 0..K-1
// in order, starting from 0 (an f32 sum stored and reloaded is the same f32), so a row's
// bits are nn_block's whatever M. MRL x NVL accumulators fit the vector registers with the
// weights and a broadcast (AVX2 has 16: 6 x 2 + 2 + 1; AVX-512 32: 8 x 3 + 3 + 1).
#if defined(__AVX512F__)
constexpr int MRL = 8;
constexpr int NVL = 3;
#else
constexpr int MRL = 6;
constexpr int NVL = 2;
#endif
constexpr int64_t KC = 256;    // rows of w per slice (a 2-vector slice: 16 KiB on AVX2)
constexpr int64_t LARGE_M = 16;  // above this many rows, the cache-blocked product (below, the
                                 // MR-row blocks read a step's weights once: faster there, measured)

// The M rows of one slice of kc rows of w (sums carried through y unless `first`).
template <int NV, typename WT>
static void nn_rows_slice(const float* x, int64_t K, const WT* w, int64_t ldw, float* y, int64_t ldy,
                          int64_t M, int64_t kc, bool first) {
  for_row_blocks<MRL>(M, [&](int64_t m, auto R) {
    nn_block<NV, decltype(R)::value, false, WT>(x + m * K, K, w, ldw, y + m * ldy, ldy, kc, first);
  });
}

// One packed tile (TW columns, rows TW apart) for all M rows: per slice of KC rows of w,
// column pieces of NVL vectors (then single vectors), all rows each; the slice of x
// (M x KC) stays in L2 across the tile's pieces.
template <typename WT>
static void nn_tile_large(const float* x, const WT* w, int64_t TW, float* y, int64_t ldy, int64_t M,
                          int64_t K) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    int64_t c = 0;
    for (; c + NVL * VW <= TW; c += NVL * VW)
      nn_rows_slice<NVL, WT>(x + k0, K, w + k0 * TW + c, TW, y + c, ldy, M, kc, k0 == 0);
    for (; c < TW; c += VW) nn_rows_slice<1, WT>(x + k0, K, w + k0 * TW + c, TW, y + c, ldy, M, kc, k0 == 0);
  }
}

// Columns n0 .. n0 + NV * VW of y[M, ldy] = x[M,K] @ w (w: that tile's first column, rows
// ldw apart), all M rows.
template <int NV, bool PF = true, typename WT = float>
static void nn_tile(const float* x, const WT* w, int64_t ldw, float* y, int64_t ldy, int64_t M,
                    int64_t K) {
  for_row_blocks<MR>(M, [&](int64_t m, auto R) {
    nn_block<NV, decltype(R)::value, PF, WT>(x + m * K, K, w, ldw, y + m * ldy, ldy, K);
  });
}

// ---------------------------------------------------------------- nt: x[M,D] @ e[V,D]^T
// y[r, v] = x[r] . e[v] for rows r < R and v in [v0, v1) (y's rows `ys` apart). A block
// is VW / KB rows of x by KB rows of e: its VW dot products are VW accumulators (FMAs
// over D), summed horizontally by one vreduce (lane i * KB + j: row i with e[v + j]).
// Every product goes through the same FMAs and the same reduction tree whatever its slot,
// and a block's missing rows (of x or e) repeat its last one, so a product's value
// depends on neither R nor the block shape: greedy (1 row, KB = VW) and a verify block
// (many rows, KB = 4) get bitwise the same logits for the same row.
constexpr int NT_AHEAD = 32;  // rows of e prefetched ahead

template <int KB>
static void nt_rows_kb(const float* x, const float* e, float* y, int64_t R, int64_t D, int64_t ys,
                       int64_t v0, int64_t v1) {
  constexpr int NB = VW / KB;  // rows of x per block
  for (int64_t v = v0; v < v1; v += KB) {
    const float* er[KB];
    for (int j = 0; j < KB; ++j) er[j] = e + std::min(v + j, v1 - 1) * D;
    const bool prefetch = v + KB + NT_AHEAD <= v1;
    for (int64_t r0 = 0; r0 < R; r0 += NB) {
      const float* xr[NB];
      for (int i = 0; i < NB; ++i) xr[i] = x + std::min<int64_t>(r0 + i, R - 1) * D;
      vec acc[VW];
      for (int a = 0; a < VW; ++a) acc[a] = vzero();
      for (int64_t d = 0; d < D; d += VW) {
        if (prefetch && r0 == 0)  // rows of e NT_AHEAD ahead
          for (int j = 0; j < KB; ++j) _mm_prefetch((const char*)(er[j] + NT_AHEAD * D + d), _MM_HINT_T0);
#pragma GCC unroll 16
        for (int a = 0; a < VW; ++a)  // slot a holds lane vslot(a)
          acc[a] = vfma(vload(xr[vslot(a) / KB] + d), vload(er[vslot(a) % KB] + d), acc[a]);
      }
      alignas(64) float out[VW];
      vstore(out, vreduce(acc));
      for (int i = 0; i < NB && r0 + i < R; ++i)
        for (int j = 0; j < KB && v + j < v1; ++j) y[(r0 + i) * ys + v + j] = out[i * KB + j];
    }
  }
}

static void nt_rows(const float* x, const float* e, float* y, int64_t R, int64_t D, int64_t ys,
                    int64_t v0, int64_t v1) {
  if (R == 1) nt_rows_kb<VW>(x, e, y, R, D, ys, v0, v1);
  else if (R == 2) nt_rows_kb<VW / 2>(x, e, y, R, D, ys, v0, v1);
  else nt_rows_kb<4>(x, e, y, R, D, ys, v0, v1);
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
  if (M == 1) {  // one row: wider tiles (NV1 vectors) stream more of each row of w at once
    constexpr int64_t TW1 = NV1 * VW;
    const int64_t wide = N / TW1, narrow = (N % TW1) / VW;
    parallel_tiles(pool, wide + narrow, [=](int64_t t) {
      const int64_t n0 = t < wide ? t * TW1 : wide * TW1 + (t - wide) * VW;
      if (t < wide) nn_block<NV1, 1, false>(xp, K, wp + n0, N, yp + n0, N, K);
      else nn_block<1, 1>(xp, K, wp + n0, N, yp + n0, N, K);
    });
    return ffi::Error::Success();
  }
  constexpr int64_t TW = 3 * VW;  // tile width
  const int64_t wide = N / TW, narrow = (N % TW) / VW;
  parallel_tiles(pool, wide + narrow, [=](int64_t t) {
    const int64_t n0 = t < wide ? t * TW : wide * TW + (t - wide) * VW;
    if (t < wide) nn_tile<3>(xp, wp + n0, N, yp + n0, N, M, K);
    else nn_tile<1>(xp, wp + n0, N, yp + n0, N, M, K);
  });
  return ffi::Error::Success();
}

// y[M, NT*TW] = x[M,K] @ w with w packed as wp[NT,K,TW]: tile t holds columns
// t*TW .. t*TW+TW-1, its K rows of TW contiguous (`cpu_kernels.pack`). A tile is then one
// contiguous stream instead of K short pieces a row of w apart, which reads the weights
// ~2x faster (each piece of a strided walk costs a TLB lookup and restarts the
// prefetcher). The FMAs are the row-major kernel's in the same order: bitwise the same y.
// Up to LARGE_M rows (decode and verify steps: reading the weights is the cost) sub-tiles
// of SW = 3, 2 or 1 vectors, each read once for all rows (`cpu_kernels.pack` makes TW = SW).
// More rows (prefill, large trees: compute is the cost) take nn_tile_large per tile:
// ~1.8x the throughput of the 8-row blocks there, as fast as XLA's and torch's GEMMs on
// the 2-core AVX2 machine (Qwen2.5-1.5B shapes at M = 256: 167-171 GFLOP/s vs 93-114).
template <typename WT>
static ffi::Error MatmulNNPackedT(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const WT* wpp,
                                  ffi::Span<const int64_t> wd, ffi::ResultBuffer<ffi::F32>& y) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[1] || wd[2] % VW)
    return ffi::Error::InvalidArgument("matmul_nn_packed: needs x[M,K], w[NT,K,TW] with TW % vector width == 0");
  const int64_t M = xd[0], K = xd[1], NT = wd[0], TW = wd[2], N = NT * TW;
  const int64_t NV = TW % (3 * VW) == 0 ? 3 : TW % (2 * VW) == 0 ? 2 : 1;
  const int64_t SW = NV * VW, subs = TW / SW;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (M > LARGE_M) {  // a prefill block: whole tiles, cache-blocked
    parallel_tiles(pool, NT, [=](int64_t t) { nn_tile_large<WT>(xp, wpp + t * K * TW, TW, yp + t * TW, N, M, K); });
    return ffi::Error::Success();
  }
  parallel_tiles(pool, NT * subs, [=](int64_t t) {
    const int64_t tile = t / subs, col = (t % subs) * SW;
    const WT* w = wpp + tile * K * TW + col;
    float* yt = yp + tile * TW + col;
    if (NV == 3) nn_tile<3, false, WT>(xp, w, TW, yt, N, M, K);
    else if (NV == 2) nn_tile<2, false, WT>(xp, w, TW, yt, N, M, K);
    else nn_tile<1, false, WT>(xp, w, TW, yt, N, M, K);
  });
  return ffi::Error::Success();
}

static ffi::Error MatmulNNPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                                 ffi::ResultBuffer<ffi::F32> y) {
  return MatmulNNPackedT<float>(pool, x, wp.typed_data(), wp.dimensions(), y);
}

// The same with bf16 weights (f32 arithmetic: each weight widened exactly to f32).
static ffi::Error MatmulNNPackedBF16(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> wp,
                                     ffi::ResultBuffer<ffi::F32> y) {
  return MatmulNNPackedT<uint16_t>(pool, x, reinterpret_cast<const uint16_t*>(wp.typed_data()),
                                   wp.dimensions(), y);
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
  constexpr int64_t TV = 4 * VW;  // rows of e per tile
  parallel_tiles(pool, (V + TV - 1) / TV, [=](int64_t t) {
    nt_rows(xp, ep, yp, M, D, V, t * TV, std::min(V, (t + 1) * TV));
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- attention
// out[b,t,k,g] = softmax_j(scale * q[b,t,k,g] . kc[b,k,j] | mask[b,t,j]) @ vc[b,k,j], j < W:
// the queries of one kv head (its G query heads x T tokens) over the first W slots of the
// cache. One call per layer replaces XLA's ~12 small ops (two
// batched dots, scale, select, max, exp, sum, divide, transposes), whose fixed costs
// dominate at decode sizes. A row without a visible slot gives zeros.
//
// Numerics are per row and do not depend on T or on masked slots: each score is one
// sequence of FMAs over H and a fixed reduction (slots in full vectors of VW; the window
// of a decode step is a multiple of VW or the whole cache), the max and the sum over visible slots
// (masked ones are exactly 0 after vexp_neg; the sum is lane-wise over full vectors of
// slots, then a fixed reduction), probabilities p / sum, then p @ v by the "nn" block
// (sequential over slots, so a masked slot's 0 adds nothing).
constexpr int64_t ATTN_ROWS = 8;  // queries per tile

static void attention_rows(const float* q, const float* kc, const float* vc, const bool* mask,
                           float* out, float* p, int64_t R, int64_t i0, int64_t G, int64_t W,
                           int64_t H, float scale) {
  // Slots past the last one any of these rows sees are masked for all of them: they would
  // add exact zeros (to the sum and to p @ v), so the tile stops at the vector of slots
  // holding that last one. A decode window is a power of two, ~1/4 masked on average.
  // The scan from the window's end skips 8 masked slots per load: a whole-cache window
  // (one compiled step for every length) then costs about what a tight one does.
  int64_t last = -1;
  for (int64_t r = 0; r < R; ++r) {
    const bool* mr = mask + ((i0 + r) / G) * W;  // query i = t*G + g
    int64_t j = W - 1;
    for (uint64_t word; j - 7 > last; j -= 8) {
      std::memcpy(&word, mr + j - 7, sizeof(word));
      if (word) break;
    }
    for (; j > last; --j)
      if (mr[j]) {
        last = j;
        break;
      }
  }
  const int64_t Wt = std::min(W, (last + VW) / VW * VW);  // W itself, or a multiple of VW
  nt_rows(q, kc, p, R, H, W, 0, Wt);  // scores p[R,Wt] = q[R,H] @ kc[Wt,H]^T (rows W apart)
  const int64_t Wv = Wt - Wt % VW;
  for (int64_t r = 0; r < R; ++r) {
    float* pr = p + r * W;
    const bool* mr = mask + ((i0 + r) / G) * W;  // query i = t*G + g
    float mx = -3.0e38f;
    bool any = false;
    for (int64_t j = 0; j < Wt; ++j) {
      float s = pr[j] * scale;
      if (mr[j]) {
        any = true;
        mx = std::max(mx, s);
        pr[j] = s;
      } else {
        pr[j] = -1.0e30f;
      }
    }
    if (!any) {
      std::fill(pr, pr + Wt, 0.0f);
      continue;
    }
    const vec neg_mx = vset1(-mx);
    vec acc = vzero();
    for (int64_t j = 0; j < Wv; j += VW) {
      vec e = vexp_neg(vadd(vload(pr + j), neg_mx));
      vstore(pr + j, e);
      acc = vadd(acc, e);
    }
    float sum = vsum(acc);
    for (int64_t j = Wv; j < Wt; ++j) {
      float buf[VW] = {0};
      buf[0] = pr[j] - mx;
      float e[VW];
      vstore(e, vexp_neg(vload(buf)));
      pr[j] = e[0];
      sum += e[0];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < Wt; ++j) pr[j] *= inv;
  }
  // out[R,H] = p[R,Wt] @ vc[Wt,H]
  for (int64_t n0 = 0; n0 < H; n0 += VW)
    for_row_blocks<MR>(R, [&](int64_t m, auto RB) {
      nn_block<1, decltype(RB)::value>(p + m * W, W, vc + n0, H, out + m * H + n0, H, Wt);
    });
}

// The queries arrive as the qkv projection leaves them, q[B,T,K,G,H], and out has that
// layout too (a [B,T,N*H] input of the output projection): no transposes around the call.
// A tile is up to ATTN_ROWS queries of one (row b, kv head k), in the order t*G + g,
// copied to a contiguous block and back (which changes no value). rows (nullptr: the
// identity): query row b reads cache row rows[b] of a cache of C rows (a prefill block
// of a few rows of the whole cache reads their slots in place, no copy of the window).
static ffi::Error attention_impl(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& kc,
                                 ffi::Buffer<ffi::F32>& vc, ffi::Buffer<ffi::PRED>& mask, const int32_t* rows,
                                 int64_t n_rows, ffi::ResultBuffer<ffi::F32>& out, float scale) {
  auto qd = q.dimensions(), kd = kc.dimensions(), vd = vc.dimensions(), md = mask.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || md.size() != 3)
    return ffi::Error::InvalidArgument("attention: needs q[B,T,K,G,H], k/v[C,K,S,H], mask[B,T,W]");
  const int64_t B = qd[0], T = qd[1], K = qd[2], G = qd[3], H = qd[4], C = kd[0], S = kd[2], W = md[2];
  for (int i = 0; i < 4; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("attention: k and v shapes differ");
  if ((rows ? n_rows != B : C != B) || kd[1] != K || kd[3] != H || md[0] != B || md[1] != T || W > S || H % VW)
    return ffi::Error::InvalidArgument("attention: inconsistent shapes (rows, W <= S, H % vector width)");
  for (int64_t b = 0; rows && b < B; ++b)
    if (rows[b] < 0 || rows[b] >= C) return ffi::Error::InvalidArgument("attention: a row index outside the cache");
  const float* qp = q.typed_data();
  const float* kp = kc.typed_data();
  const float* vp = vc.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  const int64_t Q = T * G, blocks = (Q + ATTN_ROWS - 1) / ATTN_ROWS;
  auto tile = [=](int64_t t) {
    const int64_t bk = t / blocks, i0 = (t % blocks) * ATTN_ROWS, b = bk / K, k = bk % K;
    const int64_t ck = (rows ? int64_t(rows[b]) : b) * K + k;  // the cache's (row, kv head)
    const int64_t R = std::min(ATTN_ROWS, Q - i0);
    std::unique_ptr<float[]> buf(new float[R * (W + 2 * H)]);
    float *qb = buf.get(), *ob = qb + R * H, *p = ob + R * H;
    int64_t offs[ATTN_ROWS];  // offset of each query's H values in q and out
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r, tok = i / G, g = i % G;
      offs[r] = (((b * T + tok) * K + k) * G + g) * H;
      std::copy(qp + offs[r], qp + offs[r] + H, qb + r * H);
    }
    attention_rows(qb, kp + ck * S * H, vp + ck * S * H, mp + b * T * W, ob, p, R, i0, G, W, H, scale);
    for (int64_t r = 0; r < R; ++r) std::copy(ob + r * H, ob + (r + 1) * H, op + offs[r]);
  };
  if (B * K * blocks == 1) tile(0);
  else parallel_tiles(pool, B * K * blocks, tile);
  return ffi::Error::Success();
}

static ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                            ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> mask,
                            ffi::ResultBuffer<ffi::F32> out, float scale) {
  return attention_impl(pool, q, kc, vc, mask, nullptr, 0, out, scale);
}

static ffi::Error AttentionRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                                ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> rows,
                                ffi::ResultBuffer<ffi::F32> out, float scale) {
  if (rows.dimensions().size() != 1) return ffi::Error::InvalidArgument("attention: rows must be [B]");
  return attention_impl(pool, q, kc, vc, mask, rows.typed_data(), rows.dimensions()[0], out, scale);
}

// ---------------------------------------------------------------- argmax
// idx[r] = the first index of the largest x[r, :], jnp.argmax's answer (a NaN counts as
// the largest). XLA:CPU's argmax reduce costs ~0.1 ms per row of 49k logits, this ~0.01:
// a verify block takes one per tree node. Rows with a non-finite value (NaN or inf: the
// lanes of v * 0 are then NaN) take an exact scalar pass.
static int32_t argmax_row(const float* x, int64_t V) {
  const int64_t Vv = V - V % VW;
  vec mx = vset1(-3.4028235e38f), bad = vzero(), zero = vzero();
  for (int64_t j = 0; j < Vv; j += VW) {
    vec v = vload(x + j);
    mx = vmax(mx, v);
    bad = vadd(bad, vmul(v, zero));
  }
  alignas(64) float lanes[VW];
  vstore(lanes, mx);
  float m = lanes[0];
  for (int i = 1; i < VW; ++i) m = std::max(m, lanes[i]);
  bool finite = vsum(bad) == 0.0f;
  for (int64_t j = Vv; j < V; ++j) {
    finite = finite && x[j] * 0.0f == 0.0f;
    m = std::max(m, x[j]);
  }
  if (finite) {
    for (int64_t j = 0; j < V; ++j)
      if (x[j] == m) return (int32_t)j;
  }
  int64_t best = 0;  // exact: first NaN, else first of the largest (infinities compare)
  for (int64_t j = 0; j < V; ++j) {
    if (x[j] != x[j]) return (int32_t)j;
    if (x[j] > x[best]) best = j;
  }
  return (int32_t)best;
}

static ffi::Error Argmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> idx) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] < 1) return ffi::Error::InvalidArgument("argmax: needs x[R,V], V >= 1");
  const int64_t R = xd[0], V = xd[1];
  const float* xp = x.typed_data();
  int32_t* out = idx->typed_data();
  auto row = [=](int64_t r) { out[r] = argmax_row(xp + r * V, V); };
  if (R <= 2) for (int64_t r = 0; r < R; ++r) row(r);
  else parallel_tiles(pool, R, row);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- copy
// y = x. A custom call is a fusion boundary: XLA computes x once into a buffer instead of
// fusing its producer into every consumer (`cpu_kernels.materialize`).
static ffi::Error Copy(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  std::copy(x.typed_data(), x.typed_data() + x.element_count(), y->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_copy, Copy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_argmax, Argmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nn, MatmulNN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nn_packed, MatmulNNPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nn_packed_bf16, MatmulNNPackedBF16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_matmul_nt, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_attention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_attention_rows, AttentionRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

// ---------------------------------------------------------------- KNN shortlist
// The shortlist pass of the exact KNN search (knnlm.search.exact_search): queries h[Q,D]
// f32, keys x[N,D] f16 or f32, norms[N] = |x|^2 f32 (+inf: padding) -> per query the kp
// entries of smallest m = norm - 2 h.x, ranked by (m, id): md[Q,kp], mi[Q,kp] (+inf / -1
// past the entries of finite m). The keys are read from memory once for all Q queries:
// a pair of keys is widened to f32 in registers (F16C) and used by up to QG queries per
// register block (`knn_block`), while the loop prefetches the keys it will need next.
// h.x is VW lane-wise FMA chains over D then vsum (or vreduce, whose adds form the same
// tree), the same for every Q and blocking, and
// the selection is the kp smallest by (m, id) whatever the split into tiles: a query's
// shortlist does not depend on the other queries. Rounding: one dot product in some order
// (|error| <= D u |h||x|), one product by 2 (exact) and one subtraction: within what the
// search's error bound assumes of the matmul distance.
static inline vec hload(const uint16_t* p) {  // IEEE half -> f32, exact
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

struct Cand {
  float d;
  int32_t i;
};
static inline bool cand_less(const Cand& a, const Cand& b) { return a.d < b.d || (a.d == b.d && a.i < b.i); }

// The kp smallest (d, id) pushed: a buffer of 2 kp compacted (nth_element) when full;
// `thr` is then the kp-th d. Entries pushed in increasing id may be rejected by d >= thr
// (a tie with the kp-th loses on id); others need d <= thr.
struct Selector {
  Cand* buf;
  int64_t kp, cap, n = 0;
  float thr = INFINITY;
  void push(float d, int32_t i) {
    buf[n++] = Cand{d, i};
    if (n == cap) {
      std::nth_element(buf, buf + kp - 1, buf + n, cand_less);
      n = kp;
      thr = buf[kp - 1].d;
    }
  }
  int64_t finish() {  // sorted, the first min(n, kp)
    std::sort(buf, buf + n, cand_less);
    return n = std::min(n, kp);
  }
};

static inline vec kload(const float* p) { return vload(p); }
static inline vec kload(const uint16_t* p) { return hload(p); }

// Queries per register block: 2 keys x QG queries accumulators, 2 key vectors and one
// query vector fit the register file (32 zmm; 16 ymm for AVX2).
constexpr int QG = VW == 16 ? 8 : 4;
constexpr int64_t KNN_AHEAD = 16;  // keys ahead that the dot loop prefetches into L2

// h.x for QB queries (rows of h) x KB consecutive keys (rows of x, f16 widened in
// registers): out[b * QB + a]. With PF, the loop also prefetches the KB keys at `pf` into
// L2, spread over its steps: issued in one burst at the block's start the prefetches
// stall the loads (measured: 1M x 576 f16 keys, 2 threads, 8 queries 86 ms in a burst vs
// 66 ms spread; one query 55 vs 52 ms; 70 ms without prefetching).
template <int QB, int KB, bool PF, typename KT>
static inline void knn_dots(const float* h, const KT* x, int64_t D, const char* pf, float* out) {
  constexpr int NA = QB * KB;
  constexpr int64_t STEP = KB * VW * sizeof(KT);  // bytes of the KB keys per step
  vec acc[NA];
  for (int i = 0; i < NA; ++i) acc[i] = vzero();
  for (int64_t j = 0, s = 0; j < D; j += VW, s += STEP) {
    if constexpr (PF)
      for (int64_t c = 0; c < STEP; c += 64) _mm_prefetch(pf + s + c, _MM_HINT_T1);
    vec xv[KB];
    for (int b = 0; b < KB; ++b) {
      xv[b] = kload(x + b * D + j);
      asm("" : "+v"(xv[b]));  // loaded once into a register (GCC would load it per FMA)
    }
    for (int a = 0; a < QB; ++a) {
      vec hv = vload(h + a * D + j);
      for (int b = 0; b < KB; ++b) acc[b * QB + a] = vfma(hv, xv[b], acc[b * QB + a]);
    }
  }
#if defined(__AVX512F__)
  if constexpr (NA % VW == 0) {  // vreduce's adds are vsum's tree: the same sums, fewer shuffles
    alignas(64) float r[VW];
    for (int g = 0; g < NA; g += VW) {
      vstore(r, vreduce(acc + g));
      for (int l = 0; l < VW; ++l) out[g + vslot(l)] = r[l];
    }
    return;
  }
#endif
  for (int i = 0; i < NA; ++i) out[i] = vsum(acc[i]);
}

template <int QB, int KB, typename KT>
static inline void knn_dots_pf(bool pf_on, const float* h, const KT* x, int64_t D, const char* pf, float* out) {
  if (pf_on) knn_dots<QB, KB, true>(h, x, D, pf, out);
  else knn_dots<QB, KB, false>(h, x, D, pf, out);
}

template <int KB, typename KT>
static void knn_dots_q(int qb, bool pf_on, const float* h, const KT* x, int64_t D, const char* pf, float* out) {
  switch (qb) {
    case 1: return knn_dots_pf<1, KB>(pf_on, h, x, D, pf, out);
    case 2: return knn_dots_pf<2, KB>(pf_on, h, x, D, pf, out);
    case 3: return knn_dots_pf<3, KB>(pf_on, h, x, D, pf, out);
    case 4: return knn_dots_pf<4, KB>(pf_on, h, x, D, pf, out);
#if defined(__AVX512F__)
    case 5: return knn_dots_pf<5, KB>(pf_on, h, x, D, pf, out);
    case 6: return knn_dots_pf<6, KB>(pf_on, h, x, D, pf, out);
    case 7: return knn_dots_pf<7, KB>(pf_on, h, x, D, pf, out);
    case 8: return knn_dots_pf<8, KB>(pf_on, h, x, D, pf, out);
#endif
  }
}

// Keys [k0, k1) of N for queries [0, Q): m pushed into sel[q] where below thr, each
// query's in increasing id. The keys are read from memory once for all queries: a pair
// of keys is widened in registers and used by every query group of QG from there; the
// first group's loop prefetches the pair KNN_AHEAD keys on.
template <typename KT>
static void knn_block(const float* h, int64_t Q, const KT* x, const float* norms, int64_t k0, int64_t k1,
                      int64_t N, int64_t D, Selector* sel) {
  float m[2 * QG];
  for (int64_t k = k0; k < k1; k += 2) {
    const int kb = k1 - k >= 2 ? 2 : 1;
    const char* pf = reinterpret_cast<const char*>(x + std::min(k + KNN_AHEAD, N - kb) * D);
    for (int64_t q = 0; q < Q; q += QG) {
      const int qb = (int)std::min<int64_t>(QG, Q - q);
      if (kb == 2) knn_dots_q<2>(qb, q == 0, h + q * D, x + k * D, D, pf, m);
      else knn_dots_q<1>(qb, q == 0, h + q * D, x + k * D, D, pf, m);
      for (int b = 0; b < kb; ++b)
        for (int a = 0; a < qb; ++a) {
          float d = norms[k + b] - 2.0f * m[b * qb + a];
          if (d < sel[q + a].thr) sel[q + a].push(d, (int32_t)(k + b));
        }
    }
  }
}

template <typename KT>
static void knn_shortlist(ffi::ThreadPool& pool, const float* h, const KT* x, const float* norms, int64_t Q,
                          int64_t N, int64_t D, int64_t kp, float* md, int32_t* mi) {
  // at most ~16 tiles (each thread claims several; the merge does not depend on the
  // split): every tile's selection starts empty and pays ~kp (1 + ln(TILE / kp)) pushes
  // per query before its threshold settles (8192-key tiles at 1M keys: ~7% of a batch of 8)
  const int64_t TILE = std::max<int64_t>(8192, (N / 16 + 63) / 64 * 64);
  const int64_t tiles = (N + TILE - 1) / TILE, cap = 2 * kp;
  // per tile and query: its sorted shortlist (kp) and how many entries it has
  std::unique_ptr<Cand[]> found(new Cand[tiles * Q * kp]);
  std::unique_ptr<int64_t[]> count(new int64_t[tiles * Q]);
  auto tile = [&, found = found.get(), count = count.get()](int64_t t) {
    std::unique_ptr<Cand[]> bufs(new Cand[Q * cap]);
    std::unique_ptr<Selector[]> sel(new Selector[Q]);
    for (int64_t q = 0; q < Q; ++q) sel[q] = Selector{bufs.get() + q * cap, kp, cap};
    const int64_t t0 = t * TILE, t1 = std::min(N, t0 + TILE);
    knn_block(h, Q, x, norms, t0, t1, N, D, sel.get());
    for (int64_t q = 0; q < Q; ++q) {
      int64_t n = sel[q].finish();
      std::copy(sel[q].buf, sel[q].buf + n, found + (t * Q + q) * kp);
      count[t * Q + q] = n;
    }
  };
  if (tiles == 1) tile(0);
  else parallel_tiles(pool, tiles, tile);
  std::unique_ptr<Cand[]> buf(new Cand[cap]);
  for (int64_t q = 0; q < Q; ++q) {  // merge the tiles' shortlists (any order of ids: d <= thr)
    Selector s{buf.get(), kp, cap};
    for (int64_t t = 0; t < tiles; ++t) {
      const Cand* c = found.get() + (t * Q + q) * kp;
      for (int64_t j = 0; j < count[t * Q + q] && c[j].d <= s.thr; ++j) s.push(c[j].d, c[j].i);
    }
    int64_t n = s.finish();
    for (int64_t j = 0; j < kp; ++j) {
      md[q * kp + j] = j < n ? buf[j].d : INFINITY;
      mi[q * kp + j] = j < n ? buf[j].i : -1;
    }
  }
}

template <ffi::DataType KD>
static ffi::Error KnnShortlist(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<KD> keys,
                               ffi::Buffer<ffi::F32> norms, ffi::ResultBuffer<ffi::F32> md,
                               ffi::ResultBuffer<ffi::S32> mi) {
  auto hd = h.dimensions(), kd = keys.dimensions(), od = md->dimensions();
  if (hd.size() != 2 || kd.size() < 2 || od.size() != 2 || od[0] != hd[0] || kd[kd.size() - 1] != hd[1])
    return ffi::Error::InvalidArgument("knn_shortlist: needs h[Q,D], keys[...,D], md/mi[Q,kp]");
  const int64_t Q = hd[0], D = hd[1], kp = od[1], N = keys.element_count() / std::max<int64_t>(D, 1);
  if (D % VW || (int64_t)norms.element_count() != N || kp < 1 || kp > N || N > INT32_MAX)
    return ffi::Error::InvalidArgument("knn_shortlist: D a multiple of the vector width, norms[N], 1 <= kp <= N");
  using KT = std::conditional_t<KD == ffi::F16, uint16_t, float>;
  knn_shortlist<KT>(pool, h.typed_data(), reinterpret_cast<const KT*>(keys.untyped_data()), norms.typed_data(), Q,
                    N, D, kp, md->typed_data(), mi->typed_data());
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_knn_shortlist_f16, KnnShortlist<ffi::F16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(lookahead_knn_shortlist_f32, KnnShortlist<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

extern "C" int lookahead_vector_width() { return VW; }
