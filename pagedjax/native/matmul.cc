// The CPU step's projections as one XLA FFI custom call (pagedjax.native.matmul).
//
//   x       f32 [T, K]           T rows of activations
//   panels  f32 [N / 32, K, 32]  a weight of K inputs and N outputs, held as N / 32 panels of 32
//                                outputs each, every panel's K rows of 32 contiguous
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
// Built on first use by pagedjax/native/__init__.py (g++ -O3 -march=native, without
// -ffast-math, so the order of the sums is the one written here) and checked against float64
// products in tests/test_cpu_matmul.py. AVX-512 only: elsewhere the library is not built and the
// projections stay XLA's.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX512F__)
#error "pagedjax's native matmul needs AVX-512 (the Python side does not build it without)"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 32;     // outputs per panel: two 16-wide registers
constexpr int64_t kRows = 12;      // rows of x per block: 24 accumulators
constexpr int64_t kDepth = 64;     // panel rows per pass (8 KB, kept in L1 for every block of x)

// y[t0 .. t0 + R, n0 .. n0 + 32] (+)= x[t0 .. t0 + R, k0 .. k1] times the panel's rows k0 .. k1:
// each pass sums its 64 products from zero, then the first pass (k0 == 0) stores its sums and
// later ones add theirs to y (a two-level sum: its rounding grows with 64 + K / 64 terms, not K).
template <int R>
void Block(const float* x, int64_t K, const float* panel, float* y, int64_t N, int64_t n0, int64_t t0,
           int64_t k0, int64_t k1) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const float* xr = x + t0 * K;
  for (int64_t k = k0; k < k1; ++k) {
    const __m512 w_lo = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 w_hi = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(xr[r * K + k]);
      lo[r] = _mm512_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
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

// Panels shared between the calling thread and pool tasks, claimed a range at a time. Held by
// shared_ptr: a task the pool starts only after every range is done finds nothing left.
struct Shared {
  const float* x;
  const float* panels;
  float* y;
  int64_t T, K, N, n_panels, per_item, n_items, rows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const int64_t end = std::min(n_panels, (i + 1) * per_item);
      for (int64_t p = i * per_item; p < end; ++p) {
        const float* panel = panels + p * K * kPanel;
        for (int64_t k0 = 0; k0 < K; k0 += kDepth)
          for (int64_t t0 = 0; t0 < T; t0 += rows)
            kBlocks[std::min(rows, T - t0)](x, K, panel, y, N, p * kPanel, t0, k0, std::min(K, k0 + kDepth));
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> panels,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[2] != kPanel || pd[1] != xd[1] || yd.size() != 2 || yd[0] != xd[0] ||
      yd[1] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("cpu matmul: x must be [T, K], the panels [N / 32, K, 32] and y [T, N]");
  auto s = std::make_shared<Shared>();
  s->x = x.typed_data();
  s->panels = panels.typed_data();
  s->y = y->typed_data();
  s->T = xd[0];
  s->K = xd[1];
  s->N = yd[1];
  s->n_panels = pd[0];
  if (s->T == 0 || s->N == 0) return ffi::Error::Success();
  if (s->K == 0) {
    std::fill(s->y, s->y + s->T * s->N, 0.f);
    return ffi::Error::Success();
  }
  // blocks of x as even as possible: 32 rows as 11 + 11 + 10, not 12 + 12 + 8
  const int64_t n_blocks = (s->T + kRows - 1) / kRows;
  s->rows = (s->T + n_blocks - 1) / n_blocks;
  // ranges of panels: about eight per thread, so that threads that start late still get work
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  s->per_item = std::max<int64_t>(1, s->n_panels / (8 * threads));
  s->n_items = (s->n_panels + s->per_item - 1) / s->per_item;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), s->n_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([s] { s->Work(); });
  s->Work();
  // ranges other threads claimed may still be running
  while (s->done.load(std::memory_order_acquire) < s->n_items) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuMatmul, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // x
                                  .Arg<ffi::Buffer<ffi::F32>>()    // panels
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y
