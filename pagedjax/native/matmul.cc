// The CPU step's projections as XLA FFI custom calls (pagedjax.native.matmul).
//
//   x       f32 [T, K]           T rows of activations
//   panels  a weight of K inputs and N outputs, held as N / 32 panels of 32 outputs each:
//           f32 [N / 32, K, 32]               every panel's K rows of 32 contiguous, or packed,
//           u8  [N / 32, K / 32, record]      each panel as K / 32 records of 32 inputs x 32
//                                             outputs in a smaller exact form (below)
// ->
//   y       f32 [T, N]           x times the weight
//
// Why: a decode step multiplies a few rows by every weight of the model once, so its matmuls
// are bound by streaming the weights from memory; XLA:CPU runs each of them on one thread and
// reads the weight at a fraction of the memory's rate (SmolLM2-135M's 30 layers at 8 rows:
// 425 MB in ~58 ms, ~7 GB/s, where two cores read ~19 GB/s). Here the panels are shared out over
// XLA's intra-op threads and each is read from memory once, in order: for every 64 of its rows,
// blocks of up to 12 rows of x are multiplied into 12 x 32 float32 sums held in 24 AVX-512
// registers, each value of x broadcast against two 16-wide rows of the panel. Every output
// is summed in one fixed order (fused multiply-adds over k within each run of 64 inputs, the
// runs' sums added in turn), whatever T is and wherever the row falls in its block: a row's
// result does not depend on the rows beside it (batch invariance), which XLA's matmuls do not
// promise.
//
// Packed records hold a weight whose float32 values are exactly those of a block format, as a
// GGUF checkpoint's dequantized tensors are (pagedjax.native.Panels finds the form and checks
// every value): each record's 64 rows of a run are unpacked into float32 in L1 first, then the
// same blocks as above multiply them, so a packed weight gives bit for bit the float32
// panel's result while reading a fifth (4-bit) to a half (bfloat16) of the bytes.
//   kQ4    768 B: f32 scale[32], f32 min[32], u8 q[32][16]   w[k][n] = scale[n] * q + min[n],
//                 q in 0..15, byte j of row k holding outputs j (low nibble) and j + 16 (high)
//                 (GGUF Q4_1: the product of a half-precision scale and a 4-bit integer is
//                 exact in float32, so a fused multiply-add rounds as the dequantizer's a * b + c)
//   kQ8   1152 B: f32 scale[32], i8 q[32][32]                w[k][n] = scale[n] * q (GGUF Q8_0)
//   kBF16 2048 B: bf16 w[32][32]                             w[k][n] = w, widened
//
// CPUs with AVX2 and FMA but without AVX-512 (AMD's Zen 3 and older, most Intel laptops) take
// the same passes with 8-wide registers: blocks of up to 6 rows times half a panel, 12
// accumulators; every output is still the one chain of fused multiply-adds, so the two give the
// same bits.
//
// Built on first use by pagedjax/native/__init__.py (g++ -O3 -march=native, without
// -ffast-math, so the order of the sums is the one written here) and checked against float64
// products in tests/test_cpu_matmul.py (the AVX2 build too, on an AVX-512 CPU). Elsewhere the
// library is not built and the projections stay XLA's.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "pagedjax's native matmul needs AVX-512, or AVX2 with FMA (the Python side does not build it without)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;     // outputs per panel
constexpr int64_t kDepth = 64;     // panel rows per pass (8 KB, kept in L1 for every block of x)
constexpr int64_t kRecord = 32;    // inputs per packed record

enum Kind : int32_t { kF32 = 0, kQ4 = 4, kQ8 = 8, kBF16 = 16 };

constexpr int64_t RecordBytes(int32_t kind) {
  return kind == kQ4 ? 768 : kind == kQ8 ? 1152 : kind == kBF16 ? 2048 : kRecord * kPanel * 4;
}

// Each instruction set below gives the same three things: kRows (rows of x per block), RowBlock
// (one block of rows of x times one pass of a panel) and Unpack (one packed record as float32 rows).
// Every output is the same chain of fused multiply-adds in either, so both give the same bits.

#if defined(__AVX512F__)

constexpr int64_t kRows = 12;      // rows of x per block: 24 accumulators of 16

// y[t0 .. t0 + R, n0 .. n0 + 32] (+)= x[t0 .. t0 + R, k0 .. k1] times the panel's rows k0 .. k1
// (`rows`: row k0, the next ones 32 floats apart): each pass sums its 64 products from zero,
// then the first pass (k0 == 0) stores its sums and later ones add theirs to y (a two-level
// sum: its rounding grows with 64 + K / 64 terms, not K).
template <int R>
void Block(const float* x, int64_t K, const float* rows, float* y, int64_t N, int64_t n0, int64_t t0,
           int64_t k0, int64_t k1) {
  // every loop over r unrolled: the accumulators then live in registers from start to end (left
  // as loops, GCC kept lo and hi on the stack around the k loop, zeroed by memset for R >= 9)
  __m512 lo[R], hi[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* xr = x + t0 * K;
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 w_lo = _mm512_loadu_ps(rows + (k - k0) * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(rows + (k - k0) * kPanel + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    float* out = y + (t0 + r) * N + n0;
    if (k0 > 0) {
      lo[r] = _mm512_add_ps(_mm512_loadu_ps(out), lo[r]);
      hi[r] = _mm512_add_ps(_mm512_loadu_ps(out + 16), hi[r]);
    }
    _mm512_storeu_ps(out, lo[r]);
    _mm512_storeu_ps(out + 16, hi[r]);
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr,   Block<1>, Block<2>, Block<3>,  Block<4>,  Block<5>, Block<6>,
                                        Block<7>,  Block<8>, Block<9>, Block<10>, Block<11>, Block<12>};

// Rows t0 .. t1 of x (at most kRows) times the panel's rows k0 .. k1 into its 32 outputs at n0.
void RowBlock(const float* x, int64_t K, const float* rows, float* y, int64_t N, int64_t n0, int64_t t0, int64_t t1,
              int64_t k0, int64_t k1) {
  kBlocks[t1 - t0](x, K, rows, y, N, n0, t0, k0, k1);
}

// One packed record (32 inputs x 32 outputs) as float32 rows of 32, into `out`.
void Unpack(int32_t kind, const uint8_t* rec, float* out) {
  if (kind == kQ4) {
    const float* scale = reinterpret_cast<const float*>(rec);
    const __m512 s_lo = _mm512_loadu_ps(scale), s_hi = _mm512_loadu_ps(scale + 16);
    const __m512 m_lo = _mm512_loadu_ps(scale + 32), m_hi = _mm512_loadu_ps(scale + 48);
    const uint8_t* q = rec + 256;
    const __m512i nibble = _mm512_set1_epi32(0xF);
    for (int k = 0; k < kRecord; ++k, q += 16, out += kPanel) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, nibble));
      const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      _mm512_storeu_ps(out, _mm512_fmadd_ps(s_lo, q_lo, m_lo));
      _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(s_hi, q_hi, m_hi));
    }
  } else if (kind == kQ8) {
    const float* scale = reinterpret_cast<const float*>(rec);
    const __m512 s_lo = _mm512_loadu_ps(scale), s_hi = _mm512_loadu_ps(scale + 16);
    const uint8_t* q = rec + 128;
    for (int k = 0; k < kRecord; ++k, q += 32, out += kPanel) {
      const __m512i b_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512i b_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      _mm512_storeu_ps(out, _mm512_mul_ps(s_lo, _mm512_cvtepi32_ps(b_lo)));
      _mm512_storeu_ps(out + 16, _mm512_mul_ps(s_hi, _mm512_cvtepi32_ps(b_hi)));
    }
  } else {  // kBF16: a bfloat16 is the high half of the float32 it widens to
    const uint8_t* w = rec;
    for (int k = 0; k < kRecord; ++k, w += 64, out += kPanel) {
      const __m512i h_lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      const __m512i h_hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
      _mm512_storeu_ps(out, _mm512_castsi512_ps(_mm512_slli_epi32(h_lo, 16)));
      _mm512_storeu_ps(out + 16, _mm512_castsi512_ps(_mm512_slli_epi32(h_hi, 16)));
    }
  }
}

#else  // AVX2 with FMA: 16 registers of 8

constexpr int64_t kRows = 6;       // rows of x per block: 12 accumulators of 8

// As the AVX-512 Block, over W * 8 of the panel's outputs: y[t0 .. t0 + R, n0 .. n0 + 8 W] from
// `rows` (the first of those outputs; rows still 32 floats apart). Up to 6 rows times half a
// panel: 12 accumulators, the half-row of the panel in two registers and the broadcast value of x
// in one, 15 of the 16, so nothing spills; one or two rows take the whole panel (8 accumulators),
// so that there are enough independent sums to keep both FMA units busy.
template <int R, int W>
void Block(const float* x, int64_t K, const float* rows, float* y, int64_t N, int64_t n0, int64_t t0,
           int64_t k0, int64_t k1) {
  __m256 acc[R][W];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) acc[r][j] = _mm256_setzero_ps();
  const float* xr = x + t0 * K;
  // unrolled four times over k (each sum still in k's order): the loop's own instructions were
  // a quarter of the work at 8 rows
#pragma GCC unroll 4
  for (int64_t k = k0; k < k1; ++k) {
    __m256 w[W];
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) w[j] = _mm256_loadu_ps(rows + (k - k0) * kPanel + 8 * j);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(xr + r * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < W; ++j) acc[r][j] = _mm256_fmadd_ps(xv, w[j], acc[r][j]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* out = y + (t0 + r) * N + n0;
#pragma GCC unroll 4
    for (int j = 0; j < W; ++j) {
      if (k0 > 0) acc[r][j] = _mm256_add_ps(_mm256_loadu_ps(out + 8 * j), acc[r][j]);
      _mm256_storeu_ps(out + 8 * j, acc[r][j]);
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
constexpr BlockFn kBlocks[kRows + 1] = {nullptr, Block<1, 4>, Block<2, 4>, Block<3, 2>, Block<4, 2>, Block<5, 2>,
                                        Block<6, 2>};

// Rows t0 .. t1 of x (at most kRows) times the panel's rows k0 .. k1 into its 32 outputs at n0:
// one or two rows at once, three or more each half of the panel in turn (the pass's 8 KB stay in
// L1 for both).
void RowBlock(const float* x, int64_t K, const float* rows, float* y, int64_t N, int64_t n0, int64_t t0, int64_t t1,
              int64_t k0, int64_t k1) {
  kBlocks[t1 - t0](x, K, rows, y, N, n0, t0, k0, k1);
  if (t1 - t0 > 2) kBlocks[t1 - t0](x, K, rows + 16, y, N, n0 + 16, t0, k0, k1);
}

// Eight bytes (unsigned or signed) or halves widened to eight int32 lanes.
inline __m256i Bytes8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline __m256i SignedBytes8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i Halves8(const uint8_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// One packed record (32 inputs x 32 outputs) as float32 rows of 32, into `out`: the same values
// as the AVX-512 Unpack, eight outputs at a time.
void Unpack(int32_t kind, const uint8_t* rec, float* out) {
  const float* scale = reinterpret_cast<const float*>(rec);
  if (kind == kQ4) {
    __m256 s[4], m[4];
    for (int j = 0; j < 4; ++j) s[j] = _mm256_loadu_ps(scale + 8 * j), m[j] = _mm256_loadu_ps(scale + 32 + 8 * j);
    const uint8_t* q = rec + 256;
    const __m256i nibble = _mm256_set1_epi32(0xF);
    for (int k = 0; k < kRecord; ++k, q += 16, out += kPanel) {
      const __m256i b[2] = {Bytes8(q), Bytes8(q + 8)};   // byte j: output j low, j + 16 high
      for (int j = 0; j < 2; ++j) {
        _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(s[j], _mm256_cvtepi32_ps(_mm256_and_si256(b[j], nibble)), m[j]));
        _mm256_storeu_ps(out + 16 + 8 * j,
                         _mm256_fmadd_ps(s[2 + j], _mm256_cvtepi32_ps(_mm256_srli_epi32(b[j], 4)), m[2 + j]));
      }
    }
  } else if (kind == kQ8) {
    __m256 s[4];
    for (int j = 0; j < 4; ++j) s[j] = _mm256_loadu_ps(scale + 8 * j);
    const uint8_t* q = rec + 128;
    for (int k = 0; k < kRecord; ++k, q += 32, out += kPanel)
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(out + 8 * j, _mm256_mul_ps(s[j], _mm256_cvtepi32_ps(SignedBytes8(q + 8 * j))));
  } else {  // kBF16: a bfloat16 is the high half of the float32 it widens to
    const uint8_t* w = rec;
    for (int k = 0; k < kRecord; ++k, w += 64, out += kPanel)
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(out + 8 * j, _mm256_castsi256_ps(_mm256_slli_epi32(Halves8(w + 16 * j), 16)));
  }
}

#endif

// The T rows of x, as `blocks` blocks of as even a size as can be (32 rows: 11 + 11 + 10 with
// AVX-512, 5 + 5 + 6 + 5 + 5 + 6 with AVX2), times the panel's rows k0 .. k1 into its outputs at n0.
void Pass(const float* x, int64_t K, const float* rows, float* y, int64_t N, int64_t n0, int64_t T, int64_t blocks,
          int64_t k0, int64_t k1) {
  for (int64_t b = 0; b < blocks; ++b) RowBlock(x, K, rows, y, N, n0, b * T / blocks, (b + 1) * T / blocks, k0, k1);
}

// Panels shared between the calling thread and pool tasks, claimed a range at a time. Held by
// shared_ptr: a task the pool starts only after every range is done finds nothing left.
struct Shared {
  const float* x;
  const uint8_t* panels;
  float* y;
  int32_t kind;
  int64_t T, K, N, n_panels, per_item, n_items, blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    alignas(64) float unpacked[kDepth * kPanel];   // one pass's rows of a packed panel
    const int64_t panel_bytes = kind == kF32 ? K * kPanel * 4 : (K / kRecord) * RecordBytes(kind);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const int64_t end = std::min(n_panels, (i + 1) * per_item);
      for (int64_t p = i * per_item; p < end; ++p) {
        const uint8_t* panel = panels + p * panel_bytes;
        for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
          const int64_t k1 = std::min(K, k0 + kDepth);
          const float* rows = reinterpret_cast<const float*>(panel) + k0 * kPanel;
          if (kind != kF32) {
            for (int64_t r = k0; r < k1; r += kRecord)
              Unpack(kind, panel + (r / kRecord) * RecordBytes(kind), unpacked + (r - k0) * kPanel);
            rows = unpacked;
          }
          Pass(x, K, rows, y, N, p * kPanel, T, blocks, k0, k1);
        }
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Run(ffi::ThreadPool& pool, const float* x, const uint8_t* panels, float* y, int32_t kind, int64_t T,
               int64_t K, int64_t N, int64_t n_panels) {
  if (T == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y, y + T * N, 0.f);
    return ffi::Error::Success();
  }
  auto s = std::make_shared<Shared>();
  s->x = x;
  s->panels = panels;
  s->y = y;
  s->kind = kind;
  s->T = T;
  s->K = K;
  s->N = N;
  s->n_panels = n_panels;
  s->blocks = (T + kRows - 1) / kRows;   // of x, as few as kRows allows
  // ranges of panels: about eight per thread, so that threads that start late still get work
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  s->per_item = std::max<int64_t>(1, n_panels / (8 * threads));
  s->n_items = (n_panels + s->per_item - 1) / s->per_item;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), s->n_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { s->Work(); });
  s->Work();
  // ranges other threads claimed may still be running
  while (s->done.load(std::memory_order_acquire) < s->n_items) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1] || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("cpu matmul: x must be [T, K], the panels [N / 32, K, 32] and y [T, N]");
  return Run(pool, x.typed_data(), reinterpret_cast<const uint8_t*>(panels.typed_data()), y->typed_data(), kF32,
             xd[0], xd[1], yd[1], pd[0]);
}

ffi::Error PackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> panels,
                      ffi::ResultBuffer<ffi::F32> y, int32_t kind) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (kind != kQ4 && kind != kQ8 && kind != kBF16)
    return ffi::Error::InvalidArgument("cpu matmul: kind must be 4 (q4), 8 (q8) or 16 (bf16)");
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != RecordBytes(kind) || pd[1] * kRecord != xd[1] ||
      yd.size() != 2 || yd[0] != xd[0] || yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument(
        "cpu matmul: x must be [T, K], the packed panels [N / 32, K / 32, record bytes] and y [T, N]");
  return Run(pool, x.typed_data(), panels.typed_data(), y->typed_data(), kind, xd[0], xd[1], yd[1], pd[0]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuMatmulPacked, PackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::U8>>()     // packed panels
                                  .Ret<ffi::Buffer<ffi::F32>>()    // y
                                  .Attr<int32_t>("kind"));
