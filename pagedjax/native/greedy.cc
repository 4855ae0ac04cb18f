// The CPU step's greedy choice as one XLA FFI custom call (pagedjax.native.greedy).
//
//   logits  f32 [S, V]   each row's logits (aliased with `safe`)
// ->
//   safe    f32 [S, V]   the same, a row with any non-finite logit zeroed, in place
//   token   s32 [S]      the first index of each row's maximum (of `safe`)
//   logprob f32 [S]      its log-probability, max - lse
//   lse     f32 [S]      log(sum(exp(safe))), as max + log(sum(exp(safe - max)))
//   finite  pred [S]     whether the row had only finite logits
//
// What pagedjax.runner's step computes with XLA ops (jnp.isfinite, where, max, the first index of
// the max, logsumexp), in one pass per row over data that stays in the core's cache: XLA runs
// those as six fusions over the whole [S, V] and on a CPU they cost a step several milliseconds
// (32 rows of a 49,152-token vocabulary, 2 cores: ~4 ms, against ~0.5 here). Rows go out over
// XLA's intra-op threads. The exponentials are summed in double, so lse and logprob are within
// float32 rounding of the exact values where XLA's float32 sums over the row drift a few units
// further (~1e-5 at 49,152 tokens); the token and the zeroed logits are XLA's, bit for bit.
//
// Built on first use by pagedjax/native/__init__.py (g++ -O3 -march=native -ffast-math: the
// exponentials vectorise) and checked against the XLA ops in tests/test_cpu_greedy.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// One row: x is read and (if not finite) zeroed in place. Finiteness is tested on the bits:
// -ffast-math assumes every float finite.
void Row(float* __restrict x, int64_t V, int32_t* token, float* logprob, float* lse, bool* finite) {
  uint32_t bad = 0;
  float m = x[0];
  for (int64_t v = 0; v < V; ++v) {
    uint32_t bits;
    std::memcpy(&bits, &x[v], sizeof bits);
    bad |= (bits & 0x7F800000u) == 0x7F800000u;
    m = std::max(m, x[v]);
  }
  *finite = !bad;
  if (bad) {
    std::fill(x, x + V, 0.f);
    m = 0.f;
  }
  double sum = 0.;  // float exponentials summed in double: lse within float rounding of the exact value
  for (int64_t v = 0; v < V; ++v) sum += static_cast<double>(std::exp(x[v] - m));
  int64_t first = 0;
  while (x[first] != m) ++first;  // m is one of the row's values
  *token = static_cast<int32_t>(first);
  *lse = m + static_cast<float>(std::log(sum));
  *logprob = m - *lse;
}

struct Shared {
  float* x;
  int64_t S, V;
  int32_t* token;
  float *logprob, *lse;
  bool* finite;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t s; (s = next.fetch_add(1, std::memory_order_relaxed)) < S;) {
      Row(x + s * V, V, token + s, logprob + s, lse + s, finite + s);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::F32> safe,
                ffi::ResultBuffer<ffi::S32> token, ffi::ResultBuffer<ffi::F32> logprob,
                ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::PRED> finite) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] < 1)
    return ffi::Error::InvalidArgument("cpu greedy: logits must be [S, V] with V >= 1");
  const int64_t S = d[0], V = d[1];
  float* x = safe->typed_data();
  if (x != logits.typed_data()) std::memcpy(x, logits.typed_data(), S * V * sizeof(float));
  auto sh = std::make_shared<Shared>();
  sh->x = x;
  sh->S = S;
  sh->V = V;
  sh->token = token->typed_data();
  sh->logprob = logprob->typed_data();
  sh->lse = lse->typed_data();
  sh->finite = finite->typed_data();
  // a task the pool starts after every row is done finds nothing left and touches only `sh`
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), S) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([sh] { sh->Work(); });
  sh->Work();
  while (sh->done.load(std::memory_order_acquire) < S) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuGreedy, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()     // logits
                                  .Ret<ffi::Buffer<ffi::F32>>()     // safe (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()     // token
                                  .Ret<ffi::Buffer<ffi::F32>>()     // logprob
                                  .Ret<ffi::Buffer<ffi::F32>>()     // lse
                                  .Ret<ffi::Buffer<ffi::PRED>>());  // finite
