// The CPU step's attention as one XLA FFI custom call (the "native" attention backend).
//
// Computes what `pagedjax.model.llama.context_attention` followed by `split_attention` compute
// with XLA ops: every query token attends over
//   1. its row's cached context, positions [0, start), read page by page straight from the
//      stacked pool through the row's block table, and
//   2. this step's own K/V of its row up to itself (the row's new tokens are contiguous and in
//      position order, so that is the run of same-row tokens ending at the token),
// with one online softmax. XLA spends most of the time of its version gathering pages into
// temporaries and dispatching many tiny products; here each page is read once per token group
// while it sits in L1/L2, and the work is spread over XLA's intra-op thread pool. A bfloat16
// pool is read in place: on CPUs with AVX512_BF16 by bf16 pair products (queries and softmax
// weights rounded to bf16, float32 sums: AttendHeadsBf16), else widened to float32 (LoadChunk).
//
//   q      f32 [T, KVH, G, D]      scaled queries, grouped by kv head
//   k_new  f32 [T, KVH, D]         this step's keys (rotary applied) and values
//   v_new  f32 [T, KVH, D]
//   k, v   f32|bf16|u16 [L, KVH, NB, BS, D]   the whole pool (not yet holding this step's K/V;
//          u16: bfloat16 values as their bits)
//   layer  s32 []                   which layer of the pool to read
//   tables s32 [T, P]               each token's row's block table
//   seq    s32 [T]                  each token's row, -1 for padding (output 0)
//   start  s32 [T]                  cached positions before the row's new tokens
// ->
//   o      f32 [T, KVH, G, D]       the attention output
//
// Built on first use by pagedjax/native/__init__.py (g++ -O3 -march=native -ffast-math) and
// checked against the pure-jnp ragged reference in tests/test_cpu_attention.py.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Tokens of one row (a prefill chunk) are handled together, at most this many per work item:
// the pages they share are then read from memory once, and items stay small enough to balance
// over the threads.
constexpr int64_t kGroupTokens = 8;

// Stands in for -inf: the library is built with -ffast-math (so that the loops vectorise) and
// must never compute with infinities. exp(kNoScore - m) is exactly 0 for any real score m.
constexpr float kNoScore = -1e30f;

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Shapes {
  int64_t T, KVH, G, D, L, NB, BS, P;
};

// One work item: tokens [t0, t1) of one row and one kv head; row_first is the row's first token.
struct Item {
  int64_t t0, t1, row_first, h;
};

// One token's G query heads, online-softmax state: running max, denominator, output (G x D).
struct State {
  float* mx;
  float* dn;
  float* acc;
};

// Attend one token's G query heads (q: G x D, contiguous) over n key/value rows (row j at
// k + j * D, v + j * D), updating the state. The portable version: the compiler vectorises over D.
// scratch holds G * 16 floats.
inline void AttendGeneric(const float* __restrict q, int64_t G, int64_t D, const float* __restrict k,
                          const float* __restrict v, int64_t n, State s, float* __restrict scratch) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    for (int64_t j = 0; j < nj; ++j) {  // each K row loaded once for the G heads
      const float* __restrict kj = k + (j0 + j) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* __restrict qg = q + g * D;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kj[d];
        scratch[g * 16 + j] = dot;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* __restrict sg = scratch + g * 16;
      float m_new = s.mx[g];
      for (int64_t j = 0; j < nj; ++j) m_new = std::max(m_new, sg[j]);
      const float alpha = std::exp(s.mx[g] - m_new);  // 0 on the first rows
      float sum = 0.f;
      for (int64_t j = 0; j < nj; ++j) {
        sg[j] = std::exp(sg[j] - m_new);
        sum += sg[j];
      }
      s.dn[g] = s.dn[g] * alpha + sum;
      s.mx[g] = m_new;
      float* __restrict a = s.acc + g * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    }
    for (int64_t j = 0; j < nj; ++j) {  // each V row loaded once for the G heads
      const float* __restrict vj = v + (j0 + j) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float pj = scratch[g * 16 + j];
        float* __restrict a = s.acc + g * D;
        for (int64_t d = 0; d < D; ++d) a[d] += pj * vj[d];
      }
    }
  }
}

#if defined(__AVX512F__)
// exp for x <= 0 (Cephes' expf: range reduction to [-ln2/2, ln2/2], a degree-6 polynomial,
// then a scale by 2^n): relative error ~1e-7; inputs below -87 give ~1e-38 rather than 0.
inline __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The score of 16 rows as one vector: lane j = the sum of the 16 lanes of row j's products. A
// transpose-and-add tree (45 instructions instead of 16 horizontal sums) in three steps, so that
// it can run while the rows arrive four at a time. Quad: rows 4i..4i+3, giving per 128-bit chunk
// that chunk's sums of the four rows, in order.
inline __m512 Quad(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 x1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Two Quads (eight rows) or, applied again, two of those (all sixteen): the 128-bit chunks added
// pairwise.
inline __m512 Pair(__m512 y0, __m512 y1) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Query heads g, g + 1, ... of one kv head taken kGN at a time, then the rest (kGN <= 4):
// attend(std::integral_constant<int, GN>, g) for each group, GN its size.
template <int kGN, typename F>
inline void ForHeadGroups(int64_t G, F&& attend) {
  int64_t g = 0;
  for (; g + kGN <= G; g += kGN) attend(std::integral_constant<int, kGN>{}, g);
  switch (G - g) {
    case 1: attend(std::integral_constant<int, 1>{}, g); break;
    case 2: if constexpr (kGN > 2) attend(std::integral_constant<int, 2>{}, g); break;
    case 3: if constexpr (kGN > 3) attend(std::integral_constant<int, 3>{}, g); break;
  }
}

// The scores of 16 rows for GN query heads, rows past `live` set to kNoScore. row_dot(j, part)
// writes part[g] = the 16-lane products of head g with row j (the row loaded once for all
// heads); the lanes of 16 rows are summed by Quad and Pair.
template <int GN, typename RowDot>
inline void Scores16(RowDot&& row_dot, __mmask16 live, __m512 (&sc)[GN]) {
  __m512 y[GN][4];
  for (int r = 0; r < 4; ++r) {  // four rows at a time
    __m512 part[4][GN];
    for (int j = 0; j < 4; ++j) row_dot(4 * r + j, part[j]);
    for (int g = 0; g < GN; ++g) y[g][r] = Quad(part[0][g], part[1][g], part[2][g], part[3][g]);
  }
  for (int g = 0; g < GN; ++g)
    sc[g] = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNoScore), Pair(Pair(y[g][0], y[g][1]), Pair(y[g][2], y[g][3])));
}

// One head's online-softmax update over 16 scores: the running max and denominator move, the
// output's NC chunks are rescaled, and the weights are returned (0 past `live`) as round(p)
// makes them, the denominator summing exactly those.
template <int NC, typename Round>
inline __m512 SoftmaxUpdate(__m512 sc, __mmask16 live, float* mx, float* dn, __m512 (&o)[NC], Round round) {
  const float m_old = *mx;
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(sc));
  const __m512 p = round(_mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(sc, _mm512_set1_ps(m_new)))));
  const float alpha = std::exp(m_old - m_new);  // 0 on the first rows
  *dn = *dn * alpha + _mm512_reduce_add_ps(p);
  *mx = m_new;
  const __m512 al = _mm512_set1_ps(alpha);
  for (int c = 0; c < NC; ++c) o[c] = _mm512_mul_ps(o[c], al);
  return p;
}

// A 16-float chunk of a K/V row. f32 rows: chunk c is values [16c, 16c + 16). bf16 rows (as
// their bits): 32 values fill one 64-byte load, and the two chunks made from it are the even-
// and the odd-indexed values (a shift and a mask, no shuffles) -- Order::kSplit.
// Scores do not depend on the order of d as long as q is in the same order, and
// the output accumulates in that order too, so a bf16 page is read straight from the pool.
inline __m512 LoadChunk(const float* row, int c) { return _mm512_loadu_ps(row + 16 * c); }
inline __m512 LoadChunk(const uint16_t* row, int c) {
  const __m512i x = _mm512_loadu_si512(row + 32 * (c / 2));
  return _mm512_castsi512_ps(c % 2 ? _mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))
                                   : _mm512_slli_epi32(x, 16));
}

// AttendGeneric with AVX-512 for D = 16 * DC and GN query heads at once (GN * DC <= 16, so
// that their outputs stay in registers). Rows are taken 16 at a time: 16 rows are *read* from
// each chunk start even past n (the caller guarantees they exist and are finite), and the scores
// past n are masked. Each K and V chunk is loaded (and, for bf16, widened) once for the GN heads,
// and the heads' sums are independent chains the core runs side by side.
// next_k, next_v (or null): the next page's rows, asked for (into L2) one row of each as each
// row here is scored, so the requests go out spread over the work (see Kernel::Run).
template <int DC, int GN, typename KV>
inline void AttendHeadsAvx512(const float* __restrict q, const KV* __restrict k, const KV* __restrict v, int64_t n,
                              State s, const KV* next_k = nullptr, const KV* next_v = nullptr) {
  constexpr int64_t D = 16 * DC;
  alignas(64) float pb[GN][16];
  __m512 o[GN][DC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < DC; ++c) o[g][c] = _mm512_loadu_ps(s.acc + g * D + 16 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << nj) - 1);
    const KV* kc = k + j0 * D;
    const KV* vc = v + j0 * D;
    __m512 sc[GN];
    Scores16<GN>([&](int j, __m512 (&part)[GN]) {
      const KV* kj = kc + j * D;
      if (next_k != nullptr) {
        const char* nk = reinterpret_cast<const char*>(next_k + (j0 + j) * D);
        const char* nv = reinterpret_cast<const char*>(next_v + (j0 + j) * D);
        for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(KV)); b += 64) {
          __builtin_prefetch(nk + b, 0, 2);
          __builtin_prefetch(nv + b, 0, 2);
        }
      }
      const __m512 k0 = LoadChunk(kj, 0);
      for (int g = 0; g < GN; ++g) part[g] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k0);
      for (int c = 1; c < DC; ++c) {
        const __m512 kx = LoadChunk(kj, c);
        for (int g = 0; g < GN; ++g) part[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), kx, part[g]);
      }
    }, live, sc);
    for (int g = 0; g < GN; ++g)
      _mm512_store_ps(pb[g], SoftmaxUpdate(sc[g], live, s.mx + g, s.dn + g, o[g], [](__m512 p) { return p; }));
    // values
    for (int64_t j = 0; j < nj; ++j) {
      const KV* vj = vc + j * D;
      for (int c = 0; c < DC; ++c) {
        const __m512 vx = LoadChunk(vj, c);
        for (int g = 0; g < GN; ++g) o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g][j]), vx, o[g][c]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(s.acc + g * D + 16 * c, o[g][c]);
}

#if defined(__AVX512BF16__)
// The bf16 page path on CPUs with AVX512_BF16: products of bfloat16 pairs summed into float32
// lanes (vdpbf16ps), as flash attention multiplies bf16 operands with f32 accumulation. The
// queries and the softmax weights enter as bfloat16 (rounded to nearest); every sum is float32.
// Against widening each page to f32 this halves the vector instructions per cached position.
//
// Scores: a K row's 32-value chunk against the same chunk of bf16 q gives 16 lanes of pair sums,
// in natural order of d. Values: two rows' chunks interleaved (unpacklo/hi_epi16) pair V[j][d]
// with V[j+1][d], weighted by (p[j], p[j+1]); the output lanes then run in "pairs" order
// (Order::kPairs): lane 4l + i of accumulator 2c + h is d = 32c + 8l + 4h + i. next_k, next_v:
// as AttendHeadsAvx512's.
inline __m512bh AsBh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

template <int KC, int GN>
inline void AttendHeadsBf16(const uint16_t* __restrict qb, const uint16_t* __restrict k,
                            const uint16_t* __restrict v, int64_t n, State s, const uint16_t* next_k = nullptr,
                            const uint16_t* next_v = nullptr) {
  constexpr int64_t D = 32 * KC;
  alignas(64) uint32_t pp[GN][8];  // the weights of rows 2i and 2i+1 as one bf16 pair
  __m512 o[GN][2 * KC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 2 * KC; ++c) o[g][c] = _mm512_loadu_ps(s.acc + g * D + 16 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << nj) - 1);
    const uint16_t* kc = k + j0 * D;
    const uint16_t* vc = v + j0 * D;
    __m512 sc[GN];
    Scores16<GN>([&](int j, __m512 (&part)[GN]) {
      const uint16_t* kj = kc + j * D;
      if (next_k != nullptr) {
        const char* nk = reinterpret_cast<const char*>(next_k + (j0 + j) * D);
        const char* nv = reinterpret_cast<const char*>(next_v + (j0 + j) * D);
        for (int64_t b = 0; b < D * 2; b += 64) {
          __builtin_prefetch(nk + b, 0, 2);
          __builtin_prefetch(nv + b, 0, 2);
        }
      }
      for (int g = 0; g < GN; ++g) part[g] = _mm512_setzero_ps();
      for (int c = 0; c < KC; ++c) {
        const __m512bh kx = AsBh(_mm512_loadu_si512(kj + 32 * c));
        for (int g = 0; g < GN; ++g)
          part[g] = _mm512_dpbf16_ps(part[g], kx, AsBh(_mm512_loadu_si512(qb + g * D + 32 * c)));
      }
    }, live, sc);
    for (int g = 0; g < GN; ++g) {
      // the weights rounded to bf16 (exactly representable, so converting again is exact)
      const __m512 p = SoftmaxUpdate(sc[g], live, s.mx + g, s.dn + g, o[g], [](__m512 x) {
        const __m256bh b = _mm512_cvtneps_pbh(x);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<const __m256i&>(b)), 16));
      });
      const __m256bh pb = _mm512_cvtneps_pbh(p);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), reinterpret_cast<const __m256i&>(pb));
    }
    // rows past nj have weight 0 (and exist: 16 rows are read from every chunk start)
    for (int64_t i = 0; 2 * i < nj; ++i) {
      const uint16_t* v0 = vc + 2 * i * D;
      for (int c = 0; c < KC; ++c) {
        const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
        const __m512i b = _mm512_loadu_si512(v0 + D + 32 * c);
        const __m512bh lo = AsBh(_mm512_unpacklo_epi16(a, b));
        const __m512bh hi = AsBh(_mm512_unpackhi_epi16(a, b));
        for (int g = 0; g < GN; ++g) {
          const __m512bh w = AsBh(_mm512_set1_epi32(static_cast<int>(pp[g][i])));
          o[g][2 * c] = _mm512_dpbf16_ps(o[g][2 * c], lo, w);
          o[g][2 * c + 1] = _mm512_dpbf16_ps(o[g][2 * c + 1], hi, w);
        }
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 2 * KC; ++c) _mm512_storeu_ps(s.acc + g * D + 16 * c, o[g][c]);
}

// All G query heads of one kv head, as AttendAvx512 takes them.
template <int KC>
inline void AttendBf16(const uint16_t* qb, int64_t G, const uint16_t* k, const uint16_t* v, int64_t n, State s,
                       const uint16_t* next_k = nullptr, const uint16_t* next_v = nullptr) {
  constexpr int64_t D = 32 * KC;
  ForHeadGroups<(8 / KC < 4 ? 8 / KC : 4)>(G, [&](auto gn, int64_t g) {
    AttendHeadsBf16<KC, decltype(gn)::value>(qb + g * D, k, v, n, State{s.mx + g, s.dn + g, s.acc + g * D},
                                             g == 0 ? next_k : nullptr, next_v);
  });
}
#endif

// All G query heads of one kv head (the first group asks for next_k, next_v).
template <int DC, typename KV>
inline void AttendAvx512(const float* q, int64_t G, const KV* k, const KV* v, int64_t n, State s,
                         const KV* next_k = nullptr, const KV* next_v = nullptr) {
  constexpr int64_t D = 16 * DC;
  ForHeadGroups<(16 / DC < 4 ? 16 / DC : 4)>(G, [&](auto gn, int64_t g) {
    AttendHeadsAvx512<DC, decltype(gn)::value>(q + g * D, k, v, n, State{s.mx + g, s.dn + g, s.acc + g * D},
                                               g == 0 ? next_k : nullptr, next_v);
  });
}
#endif

// The orders of d the fast paths hold queries, this step's K/V rows and the output in.
//   kNatural: d itself.
//   kSplit:   per 32 values, the 16 even-indexed then the 16 odd (LoadChunk's bf16 order).
//   kPairs:   AttendHeadsBf16's output order: lane 4l + i of 16-float chunk 2c + h holds
//             d = 32c + 8l + 4h + i.
enum class Order { kNatural, kSplit, kPairs };

// The index in d of position i of a row in `order`.
inline int64_t SourceIndex(Order order, int64_t i) {
  const int64_t b = i / 32 * 32, r = i % 32;
  switch (order) {
    case Order::kSplit: return b + (r < 16 ? 2 * r : 2 * (r - 16) + 1);
    case Order::kPairs: return b + 8 * (r % 16 / 4) + 4 * (r / 16) + r % 4;
    default: return i;
  }
}

inline void Permute(Order order, float* __restrict dst, const float* __restrict src, int64_t D) {
  if (order == Order::kNatural) {
    std::memcpy(dst, src, D * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < D; ++i) dst[i] = src[SourceIndex(order, i)];
}

// dst in natural order = src (in `order`) times scale, in one pass.
inline void UnpermuteScaled(Order order, float* __restrict dst, const float* __restrict src, float scale, int64_t D) {
  if (order == Order::kNatural) {
    for (int64_t i = 0; i < D; ++i) dst[i] = src[i] * scale;
    return;
  }
  for (int64_t i = 0; i < D; ++i) dst[SourceIndex(order, i)] = src[i] * scale;
}

inline uint16_t F32ToBf16(float x) {  // round to nearest even; x is finite
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// kD: the head dim when it is one the fast path is compiled for (64, 128), 0 otherwise.
template <typename KV, int kD>
class Kernel {
 public:
  Kernel(const Shapes& s, const float* q, const float* k_new, const float* v_new, const KV* k, const KV* v,
         int64_t layer, const int32_t* tables, const int32_t* start, float* o)
      : s_(s), q_(q), k_new_(k_new), v_new_(v_new), k_(k), v_(v), layer_(layer), tables_(tables), start_(start),
        o_(o) {}

  void Run(const Item& it) const {
    const int64_t G = s_.G, BS = s_.BS, KVH = s_.KVH;
    const int64_t D = kD ? kD : s_.D;
    const int64_t n_tok = it.t1 - it.t0;
    const int64_t ctx = start_[it.t0];
    // bf16 pages read in place (the fast paths read 16 rows from every chunk start): queries and
    // this step's keys are then held in q_order, this step's values and the output in out_order
    const bool in_place = kInPlace != Order::kNatural && BS % 16 == 0;
    const Order q_order = in_place && kInPlace == Order::kSplit ? Order::kSplit : Order::kNatural;
    const Order out_order = in_place ? kInPlace : Order::kNatural;
    std::vector<float> mx(n_tok * G, kNoScore), dn(n_tok * G, 0.f), acc(n_tok * G * D, 0.f), qv(n_tok * G * D);
    std::vector<uint16_t> qb(in_place && kInPlace == Order::kPairs ? n_tok * G * D : 0);  // bf16 queries
    std::vector<float> scratch(G * 16);
    auto state = [&](int64_t t) { return State{&mx[t * G], &dn[t * G], &acc[t * G * D]}; };
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* qt = q_ + (((it.t0 + t) * KVH + it.h) * G) * D;
      for (int64_t g = 0; g < G; ++g) Permute(q_order, &qv[(t * G + g) * D], qt + g * D, D);
    }
    for (size_t i = 0; i < qb.size(); ++i) qb[i] = F32ToBf16(qv[i]);

    // 1. the cached context, page by page
    const int32_t* table = tables_ + it.t0 * s_.P;
    const int64_t page_elems = BS * D;
    const KV* k_head = k_ + ((layer_ * KVH + it.h) * s_.NB) * page_elems;
    const KV* v_head = v_ + ((layer_ * KVH + it.h) * s_.NB) * page_elems;
    std::vector<float> kbuf, vbuf;
    if (!std::is_same_v<KV, float> && !in_place) {
      kbuf.resize(page_elems);
      vbuf.resize(page_elems);
    }
    const int64_t n_pages = (ctx + BS - 1) / BS;
    // Pages are scattered over the pool, so the hardware prefetcher cannot guess the next one:
    // it is asked for (into L2) while this one is worked on. Where the AVX-512 paths read the
    // pages (float32, bf16 widened or by pair products), its rows are asked for one at a time as
    // this page's are scored: asking for a whole page at once, before the work, left the core
    // waiting on that many requests (bench_cpu_attention.py --source, 2-core Sapphire Rapids VM,
    // batch 32, spread against up front: float32 at 234 / 916 tokens 19.5 / 60.1 ms against 20.1
    // / 64.1, bf16 pair products 12.2 / 34.4 against 13.5 / 39.2). The generic path (other head
    // dims, pages converted to float32 first) asks for the whole next page up front.
    // the AVX-512 rows path reads float32 pages straight from the pool (16 rows from each chunk)
    constexpr bool kRowsF32 = std::is_same_v<KV, float> && kD > 0 && kD % 16 == 0;
#if defined(__AVX512F__)
    const bool spread = in_place || (kRowsF32 && BS % 16 == 0);
#else
    const bool spread = false;
#endif
    for (int64_t p = 0; p < n_pages; ++p) {
      const int64_t n = std::min(BS, ctx - p * BS);
      const KV* kn = nullptr;
      const KV* vn = nullptr;
      if (p + 1 < n_pages) {
        kn = k_head + static_cast<int64_t>(table[p + 1]) * page_elems;
        vn = v_head + static_cast<int64_t>(table[p + 1]) * page_elems;
        const int64_t bytes = std::min(BS, ctx - (p + 1) * BS) * D * static_cast<int64_t>(sizeof(KV));
        for (int64_t b = 0; b < bytes && !spread; b += 64) {
          __builtin_prefetch(reinterpret_cast<const char*>(kn) + b, 0, 2);
          __builtin_prefetch(reinterpret_cast<const char*>(vn) + b, 0, 2);
        }
      }
      const KV* kp_raw = k_head + static_cast<int64_t>(table[p]) * page_elems;
      const KV* vp_raw = v_head + static_cast<int64_t>(table[p]) * page_elems;
#if defined(__AVX512F__)
      // spread: the first token's pass asks for the next page, a row per row it scores
      if constexpr (kInPlace != Order::kNatural || kRowsF32) {
        if (spread) {
          for (int64_t t = 0; t < n_tok; ++t) {
            const KV* next_k = t == 0 ? kn : nullptr;
#if defined(__AVX512BF16__)
            if constexpr (kInPlace == Order::kPairs) {
              AttendBf16<kD / 32>(&qb[t * G * D], G, kp_raw, vp_raw, n, state(t), next_k, vn);
              continue;
            }
#endif
            AttendAvx512<kD / 16>(&qv[t * G * D], G, kp_raw, vp_raw, n, state(t), next_k, vn);
          }
          continue;
        }
      }
#endif
      const float* kp;
      const float* vp;
      if constexpr (std::is_same_v<KV, float>) {
        kp = kp_raw;
        vp = vp_raw;
      } else {
        // whole page: the fast path reads 16 rows from each chunk start
        for (int64_t i = 0; i < page_elems; ++i) kbuf[i] = Bf16ToF32(kp_raw[i]);
        for (int64_t i = 0; i < page_elems; ++i) vbuf[i] = Bf16ToF32(vp_raw[i]);
        kp = kbuf.data();
        vp = vbuf.data();
      }
      for (int64_t t = 0; t < n_tok; ++t) Attend(&qv[t * G * D], kp, vp, n, BS % 16 == 0, state(t), scratch.data());
    }

    // 2. this step's own keys of the row, up to each token: copied into contiguous rows,
    // padded to a multiple of 16 with zeros for the fast path
    const int64_t n_new = it.t1 - it.row_first;
    const int64_t padded = (n_new + 15) / 16 * 16;
    std::vector<float> kr(padded * D, 0.f), vr(padded * D, 0.f);
    for (int64_t u = 0; u < n_new; ++u) {
      Permute(q_order, &kr[u * D], k_new_ + ((it.row_first + u) * KVH + it.h) * D, D);
      Permute(out_order, &vr[u * D], v_new_ + ((it.row_first + u) * KVH + it.h) * D, D);
    }
    for (int64_t t = 0; t < n_tok; ++t)
      Attend(&qv[t * G * D], kr.data(), vr.data(), it.t0 + t - it.row_first + 1, true, state(t), scratch.data());

    // 3. normalise: every token attends at least to itself, so dn > 0
    for (int64_t t = 0; t < n_tok; ++t) {
      float* out = o_ + ((it.t0 + t) * KVH + it.h) * G * D;
      for (int64_t g = 0; g < G; ++g) {
        UnpermuteScaled(out_order, out + g * D, &acc[(t * G + g) * D], 1.f / dn[t * G + g], D);
      }
    }
  }

 private:
  // How bf16 pages are read in place, where the fast path covers the head dim: kPairs with
  // AVX512_BF16's pair products, kSplit by widening to f32; kNatural: they are not.
#if defined(__AVX512BF16__)
  static constexpr Order kBf16Order = Order::kPairs;
#else
  static constexpr Order kBf16Order = Order::kSplit;
#endif
#if defined(__AVX512F__)
  static constexpr Order kInPlace =
      std::is_same_v<KV, uint16_t> && kD > 0 && kD % 32 == 0 ? kBf16Order : Order::kNatural;
#else
  static constexpr Order kInPlace = Order::kNatural;
#endif

  // rows_padded: 16 rows can be read from every chunk start
  void Attend(const float* q, const float* k, const float* v, int64_t n, bool rows_padded, State s,
              float* scratch) const {
#if defined(__AVX512F__)
    if constexpr (kD % 16 == 0 && kD > 0) {
      if (rows_padded) return AttendAvx512<kD / 16>(q, s_.G, k, v, n, s);
    }
#endif
    AttendGeneric(q, s_.G, kD ? kD : s_.D, k, v, n, s, scratch);
  }

  Shapes s_;
  const float* q_;
  const float* k_new_;
  const float* v_new_;
  const KV* k_;
  const KV* v_;
  int64_t layer_;
  const int32_t* tables_;
  const int32_t* start_;
  float* o_;
};

template <typename KV>
std::function<void(const Item&)> MakeRun(const Shapes& s, const float* q, const float* k_new, const float* v_new,
                                         const KV* k, const KV* v, int64_t layer, const int32_t* tables,
                                         const int32_t* start, float* o) {
  auto wrap = [](auto kern) { return [kern](const Item& it) { kern->Run(it); }; };
  if (s.D == 64) return wrap(std::make_shared<Kernel<KV, 64>>(s, q, k_new, v_new, k, v, layer, tables, start, o));
  if (s.D == 128) return wrap(std::make_shared<Kernel<KV, 128>>(s, q, k_new, v_new, k, v, layer, tables, start, o));
  return wrap(std::make_shared<Kernel<KV, 0>>(s, q, k_new, v_new, k, v, layer, tables, start, o));
}

// Work shared between the calling thread and pool tasks. Held by shared_ptr: a task the pool
// starts only after the caller has finished every item finds nothing left and touches nothing
// but this.
struct Shared {
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::function<void(const Item&)> run;

  void Work() {
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      run(items[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer_buf,
                ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> start,
                ffi::ResultBuffer<ffi::F32> o) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  auto nd = k_new.dimensions();
  auto td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || td.size() != 2 || nd.size() != 3)
    return ffi::Error::InvalidArgument(
        "cpu attention: q must be [T, KVH, G, D], k_new/v_new [T, KVH, D], the pool [L, KVH, NB, BS, D], "
        "tables [T, P]");
  const Shapes s{qd[0], qd[1], qd[2], qd[3], kd[0], kd[2], kd[3], td[1]};
  const auto vd = v.dimensions();
  const auto vnd = v_new.dimensions();
  if (kd[1] != s.KVH || kd[4] != s.D || td[0] != s.T || nd[0] != s.T || nd[1] != s.KVH || nd[2] != s.D ||
      !std::equal(nd.begin(), nd.end(), vnd.begin(), vnd.end()) || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      seq.element_count() != static_cast<size_t>(s.T) || start.element_count() != static_cast<size_t>(s.T) ||
      k.element_type() != v.element_type())
    return ffi::Error::InvalidArgument("cpu attention: q, k_new, v_new, pool, tables, seq and start disagree in shape "
                                       "or dtype");
  if (k.element_type() != ffi::DataType::F32 && k.element_type() != ffi::DataType::BF16 &&
      k.element_type() != ffi::DataType::U16)
    return ffi::Error::InvalidArgument("cpu attention: the pool must be float32, bfloat16 or uint16 (bfloat16 bits)");
  const int64_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= s.L)
    return ffi::Error::InvalidArgument("cpu attention: layer " + std::to_string(layer) + " outside [0, " +
                                       std::to_string(s.L) + ")");

  const int32_t* sq = seq.typed_data();
  const int32_t* st = start.typed_data();
  const int32_t* tab = tables.typed_data();
  float* op = o->typed_data();
  const int64_t tok_elems = s.KVH * s.G * s.D;

  // Work items: runs of tokens of one row, split into groups, times the kv heads. Everything
  // the kernel will index is checked here first.
  auto shared = std::make_shared<Shared>();
  for (int64_t t = 0; t < s.T;) {
    if (sq[t] < 0) {
      std::fill(op + t * tok_elems, op + (t + 1) * tok_elems, 0.f);
      ++t;
      continue;
    }
    int64_t end = t + 1;
    while (end < s.T && sq[end] == sq[t]) ++end;
    for (int64_t u = t; u < end; ++u)
      if (st[u] != st[t])
        return ffi::Error::InvalidArgument("cpu attention: tokens " + std::to_string(t) + " and " + std::to_string(u) +
                                           " of one row disagree on its cached length");
    if (st[t] < 0 || st[t] > s.P * s.BS)
      return ffi::Error::InvalidArgument("cpu attention: token " + std::to_string(t) + " has " +
                                         std::to_string(st[t]) + " cached positions, outside [0, " +
                                         std::to_string(s.P * s.BS) + "] (its block table's capacity)");
    const int64_t n_pages = (st[t] + s.BS - 1) / s.BS;
    for (int64_t u = t; u < end; ++u)
      for (int64_t p = 0; p < n_pages; ++p)
        if (tab[u * s.P + p] < 0 || tab[u * s.P + p] >= s.NB)
          return ffi::Error::InvalidArgument("cpu attention: block " + std::to_string(tab[u * s.P + p]) +
                                             " outside the pool [0, " + std::to_string(s.NB) + ")");
    for (int64_t g0 = t; g0 < end; g0 += kGroupTokens)
      for (int64_t h = 0; h < s.KVH; ++h) shared->items.push_back({g0, std::min(end, g0 + kGroupTokens), t, h});
    t = end;
  }
  if (shared->items.empty()) return ffi::Error::Success();
  // the most work first, so the last items to finish are short ones
  auto cost = [&](const Item& a) { return (st[a.t0] + a.t1 - a.row_first) * (a.t1 - a.t0); };
  std::stable_sort(shared->items.begin(), shared->items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });

  if (k.element_type() == ffi::DataType::F32)
    shared->run = MakeRun<float>(s, q.typed_data(), k_new.typed_data(), v_new.typed_data(), k.typed_data<float>(),
                                 v.typed_data<float>(), layer, tab, st, op);
  else
    shared->run = MakeRun<uint16_t>(s, q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                                    static_cast<const uint16_t*>(k.untyped_data()),
                                    static_cast<const uint16_t*>(v.untyped_data()), layer, tab, st, op);

  const int64_t n_items = static_cast<int64_t>(shared->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  // items other threads claimed may still be running
  while (shared->done.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
  return ffi::Error::Success();
}

// The same, handing the pool back as two more results that alias its operands (the kernel never
// writes them): a step that writes its K/V into the pool after the layers then depends on every
// layer's read, and XLA updates the pool in place instead of copying it to keep those reads safe.
ffi::Error ImplPassingPool(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq,
                           ffi::Buffer<ffi::S32> start, ffi::ResultBuffer<ffi::F32> o, ffi::Result<ffi::AnyBuffer>,
                           ffi::Result<ffi::AnyBuffer>) {
  return Impl(pool, q, k_new, v_new, k, v, layer_buf, tables, seq, start, o);
}

auto Operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()   // q
      .Arg<ffi::Buffer<ffi::F32>>()   // k_new
      .Arg<ffi::Buffer<ffi::F32>>()   // v_new
      .Arg<ffi::AnyBuffer>()          // k pool
      .Arg<ffi::AnyBuffer>()          // v pool
      .Arg<ffi::Buffer<ffi::S32>>()   // layer
      .Arg<ffi::Buffer<ffi::S32>>()   // tables
      .Arg<ffi::Buffer<ffi::S32>>()   // seq
      .Arg<ffi::Buffer<ffi::S32>>()   // start
      .Ret<ffi::Buffer<ffi::F32>>();  // o
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuAttention, Impl, Operands());
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuAttentionPassingPool, ImplPassingPool,
                              Operands().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());  // k, v pool
