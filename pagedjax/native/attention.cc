// The CPU step's attention as one XLA FFI custom call (the "native" attention backend).
//
// Computes what `pagedjax.model.llama.context_attention` followed by `split_attention` compute
// with XLA ops: every query token attends over
//   1. its row's cached context, positions [0, start), read page by page straight from the
//      stacked pool through the row's block table, and
//   2. this step's own K/V of its row up to itself (the row's new tokens are contiguous and in
//      position order, so that is the run of same-row tokens ending at the token),
// with one online softmax. XLA spends most of the time of its version gathering pages into
// temporaries and dispatching many tiny products; here a decode token goes over its pages in one
// pass with its state in registers (a prefill chunk's tokens a few pages at a time, so that the
// pages are read from memory once), and the work is spread over XLA's intra-op thread pool.
// Pages are laid out for these sums (see KIndex below): K with 16 positions side by side, so a
// tile's scores need no sums across lanes. A bfloat16 pool is read in place: on CPUs with
// AVX512_BF16 by bf16 pair products (queries and softmax weights rounded to bf16, float32
// sums), else widened to float32. CPUs with AVX2 and FMA but not AVX-512 take 8-wide loops over
// the same layout (AttendPageAvx2); others, and other head dims or block sizes, portable ones.
//
//   q      f32 [T, KVH, G, D]      scaled queries, grouped by kv head (but see cos)
//   k_new  f32 [T, KVH, D]         this step's keys (rotary applied, but see cos) and values
//   v_new  f32 [T, KVH, D]
//   k, v   f32|bf16|u16 [L, KVH, NB, BS, D]   the whole pool, each page of BS * D values in the
//          kernel's layout (u16: bfloat16 values as their bits), not yet holding this step's K/V
//   layer  s32 []                   which layer of the pool to read
//   tables s32 [T, P]               each token's row's block table
//   seq    s32 [T]                  each token's row, -1 for padding (output 0)
//   start  s32 [T]                  cached positions before the row's new tokens
//   slots  s32 [T]                  (the writing handlers only) each token's flat slot in the
//                                   pool, -1 for none: its K/V are written there after its reads
//   cos, sin f32 [T, D]             (the rotating handler only) q and k_new come before the
//                                   rotary embedding, which the kernel applies (then q times the
//                                   attribute `scale`), writing the rotated keys
// ->
//   o      f32 [T, KVH, G, D]       the attention output
//   k, v                            (the writing handlers only) the pool, aliased, now holding them
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
// The 8-wide loops, for CPUs with AVX2 and FMA but not AVX-512 (which take the 16-wide ones)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDJAX_AVX2 1
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

// n values of scratch, all `fill`, from buffer `slot` of the calling thread's own: an item's
// buffers are taken once per thread and grown to the largest, not allocated per item (at batch
// 32 a decode step's items are a few microseconds of work each).
template <typename T>
T* Filled(int slot, int64_t n, T fill) {
  thread_local std::vector<T> buffers[9];
  std::vector<T>& b = buffers[slot];
  if (static_cast<int64_t>(b.size()) < n) b.resize(n);
  std::fill(b.begin(), b.begin() + n, fill);
  return b.data();
}

// The rotary embedding the writing-and-rotating handler applies to the step's queries and keys
// (HF's rotate-half convention: value d pairs with d + D / 2), cos and sin [T, D] per token; the
// queries are then multiplied by scale. cos null: q and k_new come rotated and q scaled.
struct Rope {
  const float* cos = nullptr;
  const float* sin = nullptr;
  float scale = 1.f;

  // out = (x * cos + rotate_half(x) * sin) * scale, for token t's head vector x of D values
  void Apply(const float* x, int64_t t, int64_t D, float scale_by, float* out) const {
    const float* c = cos + t * D;
    const float* sn = sin + t * D;
    const int64_t h = D / 2;
    for (int64_t d = 0; d < h; ++d) out[d] = (x[d] * c[d] - x[d + h] * sn[d]) * scale_by;
    for (int64_t d = h; d < D; ++d) out[d] = (x[d] * c[d] + x[d - h] * sn[d]) * scale_by;
  }
};

// One token's G query heads, online-softmax state: running max, denominator, output (G x D).
struct State {
  float* mx;
  float* dn;
  float* acc;
};

// One head's online-softmax update over n scores (turned into their weights in place): the running
// max and denominator move and the output (D floats) is rescaled. The portable version.
inline void SoftmaxStep(float* __restrict sg, int64_t n, int64_t D, State s) {
  float m_new = *s.mx;
  for (int64_t j = 0; j < n; ++j) m_new = std::max(m_new, sg[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    sg[j] = std::exp(sg[j] - m_new);
    sum += sg[j];
  }
  // the rescale by exp(old max - new max), 0 on the first rows; where the max did not move it is
  // exactly 1, and skipping it (a scalar exp and D multiplies a head) gives the same bits
  if (m_new != *s.mx) {
    const float alpha = std::exp(*s.mx - m_new);
    *s.dn = *s.dn * alpha + sum;
    for (int64_t d = 0; d < D; ++d) s.acc[d] *= alpha;
  } else {
    *s.dn += sum;
  }
  *s.mx = m_new;
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
    for (int64_t g = 0; g < G; ++g) SoftmaxStep(scratch + g * 16, nj, D, State{s.mx + g, s.dn + g, s.acc + g * D});
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

// AttendGeneric with AVX-512 for float32 rows (D = 16 * DC) and GN query heads at once (GN * DC
// <= 16, so that their outputs stay in registers): this step's own K/V of a row, copied into
// contiguous rows. Rows are taken 16 at a time: 16 rows are *read* from each chunk start even
// past n (the caller pads them with zeros), and the scores past n are masked. Each K and V chunk
// is loaded once for the GN heads, whose sums are independent chains the core runs side by side.
template <int DC, int GN>
inline void AttendHeadsAvx512(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                              int64_t n, State s) {
  constexpr int64_t D = 16 * DC;
  alignas(64) float pb[GN][16];
  __m512 o[GN][DC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < DC; ++c) o[g][c] = _mm512_loadu_ps(s.acc + g * D + 16 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    const __mmask16 live = static_cast<__mmask16>((1u << nj) - 1);
    const float* kc = k + j0 * D;
    const float* vc = v + j0 * D;
    __m512 sc[GN];
    Scores16<GN>([&](int j, __m512 (&part)[GN]) {
      const float* kj = kc + j * D;
      const __m512 k0 = _mm512_loadu_ps(kj);
      for (int g = 0; g < GN; ++g) part[g] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k0);
      for (int c = 1; c < DC; ++c) {
        const __m512 kx = _mm512_loadu_ps(kj + 16 * c);
        for (int g = 0; g < GN; ++g) part[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * c), kx, part[g]);
      }
    }, live, sc);
    for (int g = 0; g < GN; ++g)
      _mm512_store_ps(pb[g], SoftmaxUpdate(sc[g], live, s.mx + g, s.dn + g, o[g], [](__m512 p) { return p; }));
    for (int64_t j = 0; j < nj; ++j) {
      const float* vj = vc + j * D;
      for (int c = 0; c < DC; ++c) {
        const __m512 vx = _mm512_loadu_ps(vj + 16 * c);
        for (int g = 0; g < GN; ++g) o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g][j]), vx, o[g][c]);
      }
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(s.acc + g * D + 16 * c, o[g][c]);
}

// All G query heads of one kv head.
template <int DC>
inline void AttendAvx512(const float* q, int64_t G, const float* k, const float* v, int64_t n, State s) {
  constexpr int64_t D = 16 * DC;
  ForHeadGroups<(16 / DC < 4 ? 16 / DC : 4)>(G, [&](auto gn, int64_t g) {
    AttendHeadsAvx512<DC, decltype(gn)::value>(q + g * D, k, v, n, State{s.mx + g, s.dn + g, s.acc + g * D});
  });
}
#endif

// ---------------------------------------------------------------------------------------------
// The pool's page layout. A page holds BS positions of one layer and kv head, BS * D values; the
// kernel lays them out so that 16 positions sit side by side in one vector, as its sums want
// them. With W values per 32-bit lane (1 for float32, 2 for bfloat16):
//   K: [D / W][BS][W]   position o's values d, d+1.. of one lane beside position o+1's: the
//                       scores of 16 positions are then D / W multiply-adds, no sums across lanes.
//   V: float32 pages in rows, [BS][D]; bfloat16 ones as the build's loops multiply them:
//     position pairs, [BS / 2][D][2] (AVX-512 builds): value d of positions o, o+1 in one lane,
//       so that one pair product adds both positions' weighted values to output lane d;
//     value pairs, [BS][D / 16][8][2] (other builds): values d and d+8 of each 16 of position o
//       in one lane, so that a lane row widened is two 8-value vectors of one position, both
//       times its one weight: the heads' sums need one weight register a head and no chains of
//       two multiply-adds (one page in L1, AVX2, 3 heads: values 92 -> 81 ns);
//     rows where the pairs do not fit (an odd BS; D not a multiple of 16).
// The kernel alone writes the pool (WritePool) and reads it; copies of whole blocks (swaps,
// copy-on-write) keep it. pagedjax.native.to_pages asks the library which one it was built with
// (PagedjaxValuePairs).

#if defined(__AVX512F__)
constexpr bool kBf16ValuePairs = false;
#else
constexpr bool kBf16ValuePairs = true;
#endif

// Whether AVX-512 pages of bf16 are multiplied by AVX512_BF16's pair products (vdpbf16ps: 32
// multiply-adds an instruction) or widened to float32 (16 an FMA, two shifts or masks a load).
// Which is faster depends on the core: on Intel's (2-core Sapphire Rapids-class VM) the pair
// product issues at a quarter of the FMA's rate, 52 multiply-adds a ns against 99, and the
// widened pages are faster (bench_cpu_attention, batch 32 at 916 tokens, cached 14.5 ms against
// 17.8); on AMD's Zen 4, with an earlier version of these loops, the pair products were (20.5-23.7
// against 30.1-33.8). The build says which:
// PAGEDJAX_WIDEN_BF16 (pagedjax.native passes it on Intel CPUs) widens.
#if defined(__AVX512BF16__) && !defined(PAGEDJAX_WIDEN_BF16)
constexpr bool kBf16PairProducts = true;
#else
constexpr bool kBf16PairProducts = false;
#endif

enum class ValueLayout { kRows, kPositionPairs, kValuePairs };

template <typename KV>
constexpr int64_t kLane = 4 / static_cast<int64_t>(sizeof(KV));
template <typename KV>
inline ValueLayout ValueLayoutOf(int64_t BS, int64_t D) {
  if (kLane<KV> == 1) return ValueLayout::kRows;
  if (kBf16ValuePairs) return D % 16 == 0 ? ValueLayout::kValuePairs : ValueLayout::kRows;
  return BS % 2 == 0 ? ValueLayout::kPositionPairs : ValueLayout::kRows;
}

inline int64_t KIndex(int64_t o, int64_t d, int64_t BS, int64_t W) { return ((d / W) * BS + o) * W + d % W; }
inline int64_t VIndex(int64_t o, int64_t d, int64_t D, ValueLayout l) {
  switch (l) {
    case ValueLayout::kPositionPairs: return ((o / 2) * D + d) * 2 + o % 2;
    case ValueLayout::kValuePairs: return o * D + (d / 16) * 16 + (d % 8) * 2 + (d % 16) / 8;
    default: return o * D + d;
  }
}

inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t x) { return Bf16ToF32(x); }

inline uint16_t F32ToBf16(float x) {  // round to nearest even; x is finite
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// A value as the pool stores it: a non-finite one as 0 (a request whose activations overflow
// ends with an error, and its blocks are reused by others whose attention must not meet 0 * NaN;
// tested on the bits: -ffast-math assumes every float finite).
inline bool Finite(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7F800000u) != 0x7F800000u;
}
inline void Store(float x, float* out) { *out = Finite(x) ? x : 0.f; }
inline void Store(float x, uint16_t* out) { *out = F32ToBf16(Finite(x) ? x : 0.f); }

// How many pages ahead the fast paths (AttendPages, AttendPageAvx2) ask for K and V, a line at a
// time spread over a page's work: one page of a decode token's work is shorter than the memory
// takes to answer (bench_cpu_attention.py --source, batch 32 at 916 tokens, bf16, best of 9-11:
// 2-core Zen 4 VM, scattered blocks, median: 1 ahead 50.9 ms, 2 ahead 45.3, 3 and 4 no better;
// 2-core Zen 3 VM, AVX2, the page after asked for in one burst before each page 48.8 ms
// sequential and 68.1 scattered, 2 ahead spread 33.4 and 53.7, 1, 3 or 4 ahead no better).
constexpr int64_t kAhead = 2;

#if defined(PAGEDJAX_AVX2)
// bf16 pairs in 8 32-bit lanes: the low halves (even d or even position) and the high ones
inline __m256 Even8(__m256i x) { return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)); }
inline __m256 Odd8(__m256i x) { return _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536))); }

// 8 lanes of bf16 pairs loaded once: GCC would otherwise fold the load into both the shift and the
// and of Even8 / Odd8, loading each vector twice, and the loads, not the multiply-adds, would bound
// the loops (one page in L1, one thread: 227 -> 210 ns)
inline __m256i LoadPairs(const uint16_t* p) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  asm("" : "+x"(x));
  return x;
}

// exp for x <= 0, as Exp512 in 8 lanes (the scale by 2^n added to the exponent's bits: n >= -126)
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500E-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), scale));
}

inline float Max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float Sum8(__m256 x) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// A bf16 value pair lane's high halves as float32: Odd8 with its mask read from memory, so that
// no register is held for it through the loops below (GCC hoists a constant into one, and the
// three-head loop then keeps an output in memory)
alignas(32) constexpr int32_t kHighHalves[8] = {-65536, -65536, -65536, -65536, -65536, -65536, -65536, -65536};
inline __m256 HighHalves8(__m256i x) {
  __m256i r;
  asm("vpand %1, %2, %0" : "=x"(r) : "m"(kHighHalves), "x"(x));
  return _mm256_castsi256_ps(r);
}

// A weight broadcast from memory at each use: GCC would otherwise keep each head's in a register
// for both of the loop's 16-value chunks, and the three-head loop would run out of registers
inline __m256 WeightAt(const float* p) {
  __m256 b;
  asm volatile("vbroadcastss %1, %0" : "=x"(b) : "m"(*p));
  return b;
}

// The values of H query heads (weights w[h * 16 + j], 0 past nj; outputs acc[h * D + d]) over
// positions j0 .. j0 + nj - 1 of a bf16 page in value pairs: a position's row of D values,
// 16 at a time in one lane row, widened once for the H heads into values d..d+7 and d+8..d+15,
// each times the head's weight into an output vector of its own (no output takes two
// multiply-adds in a row). Outputs of 2 * kX lane rows a head in registers at a time.
template <int D, int H>
inline void ValuePairsAvx2(const float* __restrict w, const uint16_t* __restrict vp, int64_t j0, int64_t nj,
                           float* __restrict acc) {
  constexpr int kX = H == 1 ? 4 : 2;  // 12 outputs of 3 heads, 8 of 2, 8 of 1
  static_assert(D % (16 * kX) == 0, "head dim: a multiple of 16 * kX");
  for (int64_t c0 = 0; c0 < D; c0 += 16 * kX) {
    __m256 o[H][kX][2];
    for (int h = 0; h < H; ++h)
      for (int x = 0; x < kX; ++x)
        for (int k = 0; k < 2; ++k) o[h][x][k] = _mm256_loadu_ps(acc + h * D + c0 + 16 * x + 8 * k);
    for (int64_t j = 0; j < nj; ++j) {
      const uint16_t* row = vp + (j0 + j) * D + c0;
      for (int x = 0; x < kX; ++x) {
        const __m256i v = LoadPairs(row + 16 * x);
        const __m256 lo = Even8(v), hi = HighHalves8(v);
        for (int h = 0; h < H; ++h) {
          const __m256 wj = WeightAt(w + h * 16 + j);
          o[h][x][0] = _mm256_fmadd_ps(wj, lo, o[h][x][0]);
          o[h][x][1] = _mm256_fmadd_ps(wj, hi, o[h][x][1]);
        }
      }
    }
    for (int h = 0; h < H; ++h)
      for (int x = 0; x < kX; ++x)
        for (int k = 0; k < 2; ++k) _mm256_storeu_ps(acc + h * D + c0 + 16 * x + 8 * k, o[h][x][k]);
  }
}

// One tile of a page for GN query heads (q: [GN][D]): positions j0 .. j0 + nj - 1 (nj <= 16, BS
// a multiple of 16), in the pool's layout.
//   scores: 16 positions in two 8-float vectors a head, each K lane row loaded once for the heads,
//     bf16 pairs widened to their even and odd halves, whose two products are summed before they
//     join the head's sum (one add in its chain a row, not two multiply-adds: six chains of two
//     would keep the multiply-adds waiting);
//   the online softmax, in registers: the running max moves only when a score exceeds it (then
//     the denominator and outputs are rescaled), and the weights, 0 past nj, go to w[g * 16 + j];
//   values: float32 rows, each head's outputs 64 at a time in registers; bf16 value pairs, the GN
//     heads together (ValuePairsAvx2).
// nk, nv (or null): a later page's K and V, one 64-byte line of each asked for with each K lane
// row (a 16 positions' lane row is one line, so a page's rows are as many as its lines).
template <int D, int GN, typename KV>
inline void TileAvx2(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp, int64_t BS,
                     int64_t j0, int64_t nj, State s, float* __restrict w, const char* nk, const char* nv) {
  constexpr int64_t W = kLane<KV>;
  __m256 lo[GN], hi[GN];
  for (int g = 0; g < GN; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D / W; ++i) {
    const KV* row = kp + (i * BS + j0) * W;
    if (nk != nullptr) {
      const int64_t line = ((j0 / 16) * (D / W) + i) * 64;
      __builtin_prefetch(nk + line, 0, 2);
      __builtin_prefetch(nv + line, 0, 2);
    }
    if constexpr (W == 1) {
      const __m256 a = _mm256_loadu_ps(row), b = _mm256_loadu_ps(row + 8);
      for (int g = 0; g < GN; ++g) {
        const __m256 qd = _mm256_broadcast_ss(q + g * D + i);
        lo[g] = _mm256_fmadd_ps(qd, a, lo[g]);
        hi[g] = _mm256_fmadd_ps(qd, b, hi[g]);
      }
    } else {
      const __m256i a = LoadPairs(row), b = LoadPairs(row + 16);
      const __m256 ae = Even8(a), ao = Odd8(a), be = Even8(b), bo = Odd8(b);
      for (int g = 0; g < GN; ++g) {
        const __m256 qe = _mm256_broadcast_ss(q + g * D + 2 * i), qo = _mm256_broadcast_ss(q + g * D + 2 * i + 1);
        lo[g] = _mm256_add_ps(lo[g], _mm256_fmadd_ps(qo, ao, _mm256_mul_ps(qe, ae)));
        hi[g] = _mm256_add_ps(hi[g], _mm256_fmadd_ps(qo, bo, _mm256_mul_ps(qe, be)));
      }
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nj)), lane));
  const __m256 live_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nj) - 8), lane));
  const __m256 none = _mm256_set1_ps(kNoScore);
#pragma GCC unroll 4  // else the scores' arrays stay in memory, stored at every K row
  for (int g = 0; g < GN; ++g) {
    const __m256 x_lo = _mm256_blendv_ps(none, lo[g], live_lo), x_hi = _mm256_blendv_ps(none, hi[g], live_hi);
    const float m_tile = Max8(_mm256_max_ps(x_lo, x_hi));
    if (m_tile > s.mx[g]) {  // else the rescale would be by exactly 1
      const float alpha = std::exp(s.mx[g] - m_tile);
      s.dn[g] *= alpha;
      const __m256 al = _mm256_set1_ps(alpha);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(s.acc + g * D + d, _mm256_mul_ps(al, _mm256_loadu_ps(s.acc + g * D + d)));
      s.mx[g] = m_tile;
    }
    const __m256 m = _mm256_set1_ps(s.mx[g]);
    const __m256 e_lo = _mm256_and_ps(live_lo, Exp8(_mm256_sub_ps(x_lo, m)));
    const __m256 e_hi = _mm256_and_ps(live_hi, Exp8(_mm256_sub_ps(x_hi, m)));
    s.dn[g] += Sum8(_mm256_add_ps(e_lo, e_hi));
    _mm256_storeu_ps(w + g * 16, e_lo);
    _mm256_storeu_ps(w + g * 16 + 8, e_hi);
  }
  if constexpr (kLane<KV> == 1) {
    for (int g = 0; g < GN; ++g) {
      const float* __restrict p = w + g * 16;
      for (int64_t c0 = 0; c0 < D; c0 += 64) {
        constexpr int64_t kC = D < 64 ? D / 8 : 8;  // vectors of outputs held at once
        float* __restrict a = s.acc + g * D + c0;
        __m256 o[kC];
        for (int64_t c = 0; c < kC; ++c) o[c] = _mm256_loadu_ps(a + 8 * c);
        for (int64_t j = 0; j < nj; ++j) {
          const __m256 pj = _mm256_broadcast_ss(p + j);
          const KV* row = vp + (j0 + j) * D + c0;
          for (int64_t c = 0; c < kC; ++c) o[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * c), o[c]);
        }
        for (int64_t c = 0; c < kC; ++c) _mm256_storeu_ps(a + 8 * c, o[c]);
      }
    }
  } else {  // V pages in value pairs
    ValuePairsAvx2<D, GN>(w, vp, j0, nj, s.acc);
  }
}

// AttendPage for CPUs with AVX2 and FMA but not AVX-512 (head dim D 64 or 128, BS a multiple of
// 16): the page's first n positions, 16 at a time, query heads three at a time.
// nk, nv (or null): the page kAhead on, asked for during the first tile's scores.
template <int D, typename KV>
inline void AttendPageAvx2(const float* __restrict q, int64_t G, const KV* __restrict kp, const KV* __restrict vp,
                           int64_t n, int64_t BS, State s, const char* nk, const char* nv) {
  alignas(32) float w[3 * 16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    ForHeadGroups<3>(G, [&](auto gn, int64_t g) {
      TileAvx2<D, decltype(gn)::value, KV>(q + g * D, kp, vp, BS, j0, std::min<int64_t>(16, n - j0),
                                           State{s.mx + g, s.dn + g, s.acc + g * D}, w,
                                           g == 0 ? nk : nullptr, nv);
    });
  }
}
#endif

// AttendGeneric over one page in the pool's layout (its first n positions), the portable version:
// the compiler vectorises the scores over the positions (a float32 page holds one d of all of
// them contiguous) and the values over d. scratch holds G * BS floats.
template <typename KV>
inline void AttendPage(const float* __restrict q, int64_t G, int64_t D, const KV* __restrict kp,
                       const KV* __restrict vp, int64_t n, int64_t BS, State s, float* __restrict scratch) {
  constexpr int64_t W = kLane<KV>;
  // scores [G][n], 16 positions at a time in registers where the page has them
  int64_t j0 = 0;
  for (; j0 + 16 <= n || (j0 < n && j0 + 16 <= BS); j0 += 16) {
    const int64_t nj = std::min<int64_t>(16, n - j0);
    for (int64_t g = 0; g < G; ++g) {
      alignas(64) float sc[16] = {};
      if constexpr (W == 1) {  // as two 8-float vectors (GCC vector types: AVX2 registers)
        typedef float F8 __attribute__((vector_size(32)));
        F8 lo = {}, hi = {};
        for (int64_t d = 0; d < D; ++d) {
          F8 a, b;
          std::memcpy(&a, kp + d * BS + j0, sizeof a);
          std::memcpy(&b, kp + d * BS + j0 + 8, sizeof b);
          lo += q[g * D + d] * a;
          hi += q[g * D + d] * b;
        }
        std::memcpy(sc, &lo, sizeof lo);
        std::memcpy(sc + 8, &hi, sizeof hi);
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float qd = q[g * D + d];
          const KV* __restrict kd = kp + ((d / W) * BS + j0) * W + d % W;
          for (int j = 0; j < 16; ++j) sc[j] += qd * ToF32(kd[j * W]);
        }
      }
      std::copy(sc, sc + nj, scratch + g * n + j0);
    }
  }
  if (j0 < n) {
    for (int64_t g = 0; g < G; ++g) std::fill(scratch + g * n + j0, scratch + (g + 1) * n, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const KV* __restrict kd = kp + (d / W) * BS * W + d % W;
      for (int64_t g = 0; g < G; ++g) {
        const float qd = q[g * D + d];
        float* __restrict sg = scratch + g * n;
        for (int64_t j = j0; j < n; ++j) sg[j] += qd * ToF32(kd[j * W]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) SoftmaxStep(scratch + g * n, n, D, State{s.mx + g, s.dn + g, s.acc + g * D});
  auto values = [&](auto layout) {  // the layout as a constant, so that the loops over d vectorise
    constexpr ValueLayout kL = decltype(layout)::value;
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const float pj = scratch[g * n + j];
        float* __restrict a = s.acc + g * D;
        if constexpr (kL == ValueLayout::kValuePairs) {  // values d, d + 8 of each 16 in one lane
          const KV* __restrict vj = vp + j * D;
          for (int64_t c = 0; c < D; c += 16)
            for (int64_t i = 0; i < 8; ++i) {
              a[c + i] += pj * ToF32(vj[c + 2 * i]);
              a[c + 8 + i] += pj * ToF32(vj[c + 2 * i + 1]);
            }
        } else {
          constexpr int64_t kW = kL == ValueLayout::kPositionPairs ? 2 : 1;
          const KV* __restrict vj = vp + (j / kW) * D * kW + j % kW;  // value d at vj[d * kW]
          for (int64_t d = 0; d < D; ++d) a[d] += pj * ToF32(vj[d * kW]);
        }
      }
    }
  };
  switch (ValueLayoutOf<KV>(BS, D)) {
    case ValueLayout::kPositionPairs: values(std::integral_constant<ValueLayout, ValueLayout::kPositionPairs>{}); break;
    case ValueLayout::kValuePairs: values(std::integral_constant<ValueLayout, ValueLayout::kValuePairs>{}); break;
    default: values(std::integral_constant<ValueLayout, ValueLayout::kRows>{});
  }
}

#if defined(__AVX512F__)
inline __m512 Even(__m512i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)); }  // bf16 pairs' low halves
inline __m512 Odd(__m512i x) {
  return _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

#if defined(__AVX512BF16__)
inline __m512bh AsBh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }
#endif


// One token's GN query heads (of one kv head, D = 16 * DC) over pages [p0, p1) of its row's
// context ctx, in the pool's layout, the online-softmax state held in registers throughout and
// a page's 16-position tiles taken in turn (BS a multiple of 16). q: the heads' queries [GN][D];
// qp (kPairs only): the same rounded to bf16, as pairs [GN][D / 2].
//   float32 pages: a K lane row times the broadcast q[d], a V row times the broadcast weight.
//   bfloat16, kPairs (AVX512_BF16): pair products (vdpbf16ps) of K lane rows with q's pairs and
//     of V lane rows with the weight pairs of two positions; queries and weights enter rounded to
//     bf16, as flash attention multiplies them on an accelerator, and every sum is float32.
//   bfloat16 otherwise: each lane row widened to its even and odd halves, float32 products.
// The softmax max moves only when a tile's score exceeds it (then the outputs are rescaled); the
// denominator is summed in a vector and across its lanes once, at the end. prefetch: the K and V
// of the page kAhead pages on are asked for (into L2), one 64-byte line with each K load, so the
// requests go out spread over the work: pages are scattered over the pool and the hardware
// prefetcher cannot guess the next one. Past the last page the stream runs on into `after`, the
// pages of the row this thread takes next.
template <typename KV>
struct PageStream {
  const KV* k_head = nullptr;
  const KV* v_head = nullptr;
  const int32_t* table = nullptr;
  int64_t n_pages = 0;
};

// kBS: the block size where it is 16 (the default), so that every K and V load of a page is at
// an offset known when compiling; 0 otherwise.
template <int DC, int GN, typename KV, bool kPairs, int kBS>
inline void AttendPages(const float* __restrict q, [[maybe_unused]] const uint32_t* __restrict qp, const KV* k_head,
                        const KV* v_head, const int32_t* table, int64_t p0, int64_t p1, int64_t ctx,
                        int64_t block_size, State s, bool prefetch, const PageStream<KV>& after) {
  constexpr int64_t D = 16 * DC;
  const int64_t BS = kBS ? kBS : block_size;
  constexpr int64_t W = kLane<KV>;
  const int64_t page = BS * D;
  const int64_t n_pages = (ctx + BS - 1) / BS;
  __m512 o[GN][DC], dnv[GN];
  float m[GN], dn[GN];
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < DC; ++c) o[g][c] = _mm512_loadu_ps(s.acc + g * D + 16 * c);
    dnv[g] = _mm512_setzero_ps();
    m[g] = s.mx[g];
    dn[g] = s.dn[g];
  }
  alignas(64) float pf[GN][16];    // the weights (float32 products)
  [[maybe_unused]] alignas(64) uint32_t pp[GN][8];  // the weights of positions 2i, 2i+1 as one bf16 pair (kPairs)
  if (prefetch && p0 == 0 && kAhead > 1 && n_pages > 1) {  // the pages no earlier page asks for
    for (int64_t b = 0; b < page * static_cast<int64_t>(sizeof(KV)); b += 64) {
      __builtin_prefetch(reinterpret_cast<const char*>(k_head + static_cast<int64_t>(table[1]) * page) + b, 0, 2);
      __builtin_prefetch(reinterpret_cast<const char*>(v_head + static_cast<int64_t>(table[1]) * page) + b, 0, 2);
    }
  }
  for (int64_t p = p0; p < p1; ++p) {
    const KV* kp = k_head + static_cast<int64_t>(table[p]) * page;
    const KV* vp = v_head + static_cast<int64_t>(table[p]) * page;
    // with nothing to ask for, this page's own lines (in cache already): no branch per load
    const char* nk = reinterpret_cast<const char*>(kp);
    const char* nv = reinterpret_cast<const char*>(vp);
    if (prefetch && p + kAhead < n_pages) {
      nk = reinterpret_cast<const char*>(k_head + static_cast<int64_t>(table[p + kAhead]) * page);
      nv = reinterpret_cast<const char*>(v_head + static_cast<int64_t>(table[p + kAhead]) * page);
    } else if (prefetch && p + kAhead - n_pages < after.n_pages) {
      const int64_t block = after.table[p + kAhead - n_pages];
      nk = reinterpret_cast<const char*>(after.k_head + block * page);
      nv = reinterpret_cast<const char*>(after.v_head + block * page);
    }
    const int64_t n = std::min(BS, ctx - p * BS);
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int64_t nj = std::min<int64_t>(16, n - j0);
      const __mmask16 live = static_cast<__mmask16>((1u << nj) - 1);
      // scores: two chains per head, so that the core always has six or more sums in flight;
      // a page's lines are as many as its K loads (64 bytes each), so each load asks for one
      __m512 sc[GN][2];
      for (int g = 0; g < GN; ++g) sc[g][0] = sc[g][1] = _mm512_setzero_ps();
#pragma GCC unroll 64
      for (int64_t i = 0; i < D / W; ++i) {
        const KV* row = kp + (i * BS + j0) * W;
        const int64_t line = ((j0 / 16) * (D / W) + i) * 64;
        __builtin_prefetch(nk + line, 0, 2);
        __builtin_prefetch(nv + line, 0, 2);
        if constexpr (W == 1) {
          const __m512 kx = _mm512_loadu_ps(row);
          for (int g = 0; g < GN; ++g) sc[g][i & 1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + i]), kx, sc[g][i & 1]);
        } else if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          const __m512bh kx = AsBh(_mm512_loadu_si512(row));
          for (int g = 0; g < GN; ++g)
            sc[g][i & 1] = _mm512_dpbf16_ps(sc[g][i & 1], kx, AsBh(_mm512_set1_epi32(static_cast<int>(qp[g * D / 2 + i]))));
#endif
        } else {
          const __m512i x = _mm512_loadu_si512(row);
          const __m512 ke = Even(x), ko = Odd(x);
          for (int g = 0; g < GN; ++g) {
            sc[g][i & 1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * i]), ke, sc[g][i & 1]);
            sc[g][i & 1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g * D + 2 * i + 1]), ko, sc[g][i & 1]);
          }
        }
      }
      // the softmax
      for (int g = 0; g < GN; ++g) {
        const __m512 x = _mm512_mask_blend_ps(live, _mm512_set1_ps(kNoScore), _mm512_add_ps(sc[g][0], sc[g][1]));
        if (_mm512_cmp_ps_mask(x, _mm512_set1_ps(m[g]), _CMP_GT_OQ)) {
          const float m_new = std::max(m[g], _mm512_reduce_max_ps(x));
          // exp in vector registers: a call to the scalar exp here would make the compiler keep
          // the outputs in memory around it (~1e-38 rather than 0 on the first positions)
          const __m512 al = Exp512(_mm512_set1_ps(m[g] - m_new));
          const float alpha = _mm512_cvtss_f32(al);
          for (int c = 0; c < DC; ++c) o[g][c] = _mm512_mul_ps(o[g][c], al);
          dnv[g] = _mm512_mul_ps(dnv[g], al);
          dn[g] *= alpha;
          m[g] = m_new;
        }
        const __m512 w = _mm512_maskz_mov_ps(live, Exp512(_mm512_sub_ps(x, _mm512_set1_ps(m[g]))));
        if constexpr (W == 2 && kPairs) {
#if defined(__AVX512BF16__)
          // the denominator sums the weights as they enter the products: rounded to bf16
          const __m256bh b = _mm512_cvtneps_pbh(w);
          const __m256i bits = reinterpret_cast<const __m256i&>(b);
          _mm256_store_si256(reinterpret_cast<__m256i*>(pp[g]), bits);
          dnv[g] = _mm512_add_ps(dnv[g], _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
#endif
        } else {
          _mm512_store_ps(pf[g], w);
          dnv[g] = _mm512_add_ps(dnv[g], w);
        }
      }
      // the values (positions past nj have weight 0)
      if constexpr (W == 1) {
        for (int64_t j = 0; j < nj; ++j) {
          const KV* row = vp + (j0 + j) * D;
          for (int c = 0; c < DC; ++c) {
            const __m512 vx = _mm512_loadu_ps(row + 16 * c);
            for (int g = 0; g < GN; ++g) o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(pf[g][j]), vx, o[g][c]);
          }
        }
      } else {
        for (int64_t i = 0; 2 * i < nj; ++i) {
          const KV* row = vp + (j0 + 2 * i) * D;  // lane row of positions j0 + 2i, j0 + 2i + 1
          for (int c = 0; c < DC; ++c) {
            const __m512i x = _mm512_loadu_si512(row + 32 * c);
            if constexpr (kPairs) {
#if defined(__AVX512BF16__)
              for (int g = 0; g < GN; ++g)
                o[g][c] = _mm512_dpbf16_ps(o[g][c], AsBh(x), AsBh(_mm512_set1_epi32(static_cast<int>(pp[g][i]))));
#endif
            } else {
              const __m512 ve = Even(x), vo = Odd(x);
              for (int g = 0; g < GN; ++g) {
                o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(pf[g][2 * i]), ve, o[g][c]);
                o[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(pf[g][2 * i + 1]), vo, o[g][c]);
              }
            }
          }
        }
      }
    }
  }
  for (int g = 0; g < GN; ++g) {
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(s.acc + g * D + 16 * c, o[g][c]);
    s.mx[g] = m[g];
    s.dn[g] = dn[g] + _mm512_reduce_add_ps(dnv[g]);
  }
}
#endif

// kD: the head dim when it is one the fast path is compiled for (64, 128), 0 otherwise.
template <typename KV, int kD>
class Kernel {
 public:
  Kernel(const Shapes& s, const float* q, const float* k_new, const float* v_new, const KV* k, const KV* v,
         int64_t layer, const int32_t* tables, const int32_t* start, float* o, const Rope& rope)
      : s_(s), q_(q), k_new_(k_new), v_new_(v_new), k_(k), v_(v), layer_(layer), tables_(tables), start_(start),
        o_(o), rope_(rope) {}

  // next: the item this thread runs after this one (or null); this one's last pages ask for its
  // first, so that the pages asked for ahead run on from one row to the next
  // (bench_cpu_attention.py, batch 32, bf16, 2-core Zen 3 VM, in turn: at 17 tokens, two pages a
  // row, 6.2-6.7 ms against 8.1-8.9; at 916 tokens the same within noise)
  void Run(const Item& it, [[maybe_unused]] const Item* next) const {
    const int64_t G = s_.G, BS = s_.BS, KVH = s_.KVH;
    const int64_t D = kD ? kD : s_.D;
    const int64_t n_tok = it.t1 - it.t0;
    const int64_t ctx = start_[it.t0];
    float* mx = Filled<float>(0, n_tok * G, kNoScore);
    float* dn = Filled<float>(1, n_tok * G, 0.f);
    float* acc = Filled<float>(2, n_tok * G * D, 0.f);
    const float* q0 = q_ + ((it.t0 * KVH + it.h) * G) * D;  // token t's heads at q0 + t * q_step
    int64_t q_step = KVH * G * D;
    if (rope_.cos != nullptr) {  // the item's queries rotated and scaled, side by side
      float* qr = Filled<float>(7, n_tok * G * D, 0.f);
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t g = 0; g < G; ++g) rope_.Apply(q0 + t * q_step + g * D, it.t0 + t, D, rope_.scale, qr + (t * G + g) * D);
      q0 = qr;
      q_step = G * D;
    }
    auto q_of = [&](int64_t t) { return q0 + t * q_step; };
    auto state = [&](int64_t t) { return State{&mx[t * G], &dn[t * G], &acc[t * G * D]}; };

    // 1. the cached context, page by page
    const int64_t page_elems = BS * D;
    const int64_t n_pages = CachedPages(it);
    bool done = false;
#if defined(__AVX512F__)
    if constexpr (kD > 0) {
      if (BS % 16 == 0) {
        const int32_t* table = TableOf(it);
        const KV* k_head = HeadOf(k_, it);
        const KV* v_head = HeadOf(v_, it);
        // one token (a decode step) goes over all its pages in one pass; a prefill chunk's
        // tokens take a few pages at a time in turn, so those pages are read from memory once
        uint32_t* qp = Filled<uint32_t>(0, kPairs ? n_tok * G * D / 2 : 0, 0u);  // bf16 queries, as pairs
        for (int64_t t = 0; kPairs && t < n_tok; ++t)
          for (int64_t i = 0; i < G * D / 2; ++i)
            qp[t * G * D / 2 + i] = F32ToBf16(q_of(t)[2 * i]) | static_cast<uint32_t>(F32ToBf16(q_of(t)[2 * i + 1])) << 16;
        PageStream<KV> after;  // the next row's pages, where this thread has one
        if (next != nullptr)
          after = PageStream<KV>{HeadOf(k_, *next), HeadOf(v_, *next), TableOf(*next), CachedPages(*next)};
        const int64_t span = n_tok == 1 ? n_pages : kSpanPages;
        for (int64_t p0 = 0; p0 < n_pages; p0 += span) {
          const int64_t p1 = std::min(n_pages, p0 + span);
          for (int64_t t = 0; t < n_tok; ++t) {
            ForHeadGroups<(16 / (kD / 16) < 4 ? 16 / (kD / 16) : 4)>(G, [&](auto gn, int64_t g) {
              const State st = state(t);
              auto attend = [&](auto bs) {
                AttendPages<kD / 16, decltype(gn)::value, KV, kPairs, decltype(bs)::value>(
                    q_of(t) + g * D, kPairs ? &qp[(t * G + g) * D / 2] : nullptr, k_head, v_head, table, p0, p1, ctx,
                    BS, State{st.mx + g, st.dn + g, st.acc + g * D}, t == 0 && g == 0, after);
              };
              if (BS == 16)
                attend(std::integral_constant<int, 16>{});
              else
                attend(std::integral_constant<int, 0>{});
            });
          }
        }
        done = true;
      }
    }
#endif
    if (!done) {
      // no AVX-512, or other head dims and block sizes: the AVX2 version where it applies (the
      // page kAhead on asked for a line at a time during each page's scores), else the portable
      // one (the next page asked for up front, all its lines at once)
      float* scratch = Filled<float>(3, G * BS, 0.f);
#if defined(PAGEDJAX_AVX2)
      const bool avx2 = kD > 0 && BS % 16 == 0;
#else
      const bool avx2 = false;
#endif
      auto bytes = [](const KV* x) { return reinterpret_cast<const char*>(x); };
      auto ask_all = [&](int64_t p) {  // all of page p's K and V lines at once
        for (int64_t b = 0; b < page_elems * static_cast<int64_t>(sizeof(KV)); b += 64) {
          __builtin_prefetch(bytes(PageOf(k_, it, p)) + b, 0, 2);
          __builtin_prefetch(bytes(PageOf(v_, it, p)) + b, 0, 2);
        }
      };
      // no earlier page of this item asks for these (the item before it on this thread may have)
      for (int64_t a = 1; avx2 && a < std::min(kAhead, n_pages); ++a) ask_all(a);
      for (int64_t p = 0; p < n_pages; ++p) {
        if (!avx2 && p + 1 < n_pages) ask_all(p + 1);
        const int64_t n = std::min(BS, ctx - p * BS);
        const KV* kp = PageOf(k_, it, p);
        const KV* vp = PageOf(v_, it, p);
#if defined(PAGEDJAX_AVX2)
        if constexpr (kD > 0) {
          if (avx2) {
            // the page kAhead on in this thread's stream: this item's, past its last the next's
            const int64_t ahead = p + kAhead;
            const Item* owner = ahead < n_pages ? &it : next;
            const int64_t pa = ahead < n_pages ? ahead : ahead - n_pages;
            const bool ask = owner != nullptr && pa < CachedPages(*owner);
            const char* nk = ask ? bytes(PageOf(k_, *owner, pa)) : nullptr;
            const char* nv = ask ? bytes(PageOf(v_, *owner, pa)) : nullptr;
            for (int64_t t = 0; t < n_tok; ++t)
              AttendPageAvx2<kD, KV>(q_of(t), G, kp, vp, n, BS, state(t), t == 0 ? nk : nullptr, nv);
            continue;
          }
        }
#endif
        for (int64_t t = 0; t < n_tok; ++t) AttendPage(q_of(t), G, D, kp, vp, n, BS, state(t), scratch);
      }
    }

    // 2. this step's own keys of the row, up to each token: copied into contiguous rows,
    // padded to a multiple of 16 with zeros for the fast path
    const int64_t n_new = it.t1 - it.row_first;
    const int64_t padded = (n_new + 15) / 16 * 16;
    float* kr = Filled<float>(4, padded * D, 0.f);
    float* vr = Filled<float>(5, padded * D, 0.f);
    for (int64_t u = 0; u < n_new; ++u) {
      const float* ku = k_new_ + ((it.row_first + u) * KVH + it.h) * D;
      if (rope_.cos != nullptr)
        rope_.Apply(ku, it.row_first + u, D, 1.f, &kr[u * D]);
      else
        std::memcpy(&kr[u * D], ku, D * sizeof(float));
      std::memcpy(&vr[u * D], v_new_ + ((it.row_first + u) * KVH + it.h) * D, D * sizeof(float));
    }
    for (int64_t t = 0; t < n_tok; ++t)
      Attend(q_of(t), kr, vr, it.t0 + t - it.row_first + 1, true, state(t));

    // 3. normalise: every token attends at least to itself, so dn > 0
    for (int64_t t = 0; t < n_tok; ++t) {
      float* out = o_ + ((it.t0 + t) * KVH + it.h) * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float scale = 1.f / dn[t * G + g];
        for (int64_t d = 0; d < D; ++d) out[g * D + d] = acc[(t * G + g) * D + d] * scale;
      }
    }
  }

 private:
  // item it's pages of cached context, and its page p (its block table's p-th block) of pool x
  // (k_ or v_) in this layer and its kv head
  // (HeadOf: block 0 of this layer's and its kv head's pages; TableOf: its block table)
  int64_t CachedPages(const Item& it) const { return (start_[it.t0] + s_.BS - 1) / s_.BS; }
  const int32_t* TableOf(const Item& it) const { return tables_ + it.t0 * s_.P; }
  const KV* HeadOf(const KV* x, const Item& it) const {
    return x + (layer_ * s_.KVH + it.h) * s_.NB * s_.BS * (kD ? kD : s_.D);
  }
  const KV* PageOf(const KV* x, const Item& it, int64_t p) const {
    return HeadOf(x, it) + static_cast<int64_t>(TableOf(it)[p]) * s_.BS * (kD ? kD : s_.D);
  }

  // whether a bf16 pool is read by pair products (AVX512_BF16) rather than widened
  static constexpr bool kPairs = kBf16PairProducts && std::is_same_v<KV, uint16_t>;
  // pages a prefill chunk's tokens take in turn (4 of 16 positions: 16 KB of bf16 K and V at
  // head dim 64, which stay in L1/L2 while the chunk's 8 tokens go over them)
  static constexpr int64_t kSpanPages = 4;

  // rows_padded: 16 rows can be read from every chunk start
  void Attend(const float* q, const float* k, const float* v, int64_t n, [[maybe_unused]] bool rows_padded, State s) const {
#if defined(__AVX512F__)
    if constexpr (kD % 16 == 0 && kD > 0) {
      if (rows_padded) return AttendAvx512<kD / 16>(q, s_.G, k, v, n, s);
    }
#endif
    AttendGeneric(q, s_.G, kD ? kD : s_.D, k, v, n, s, Filled<float>(6, s_.G * 16, 0.f));
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
  Rope rope_;
};

// Tokens [t0, t1)'s own K and V for kv heads [h0, h1) into the pool's layer at their slots: what
// `pagedjax.attention.cache.write_kv` does for the pools of the other backends, in this kernel's
// page layout. Slot -1 (padding) writes nothing.
template <typename KV>
void WritePool(const Shapes& s, int64_t layer, const float* __restrict k_new, const float* __restrict v_new,
               const int32_t* slots, KV* __restrict k, KV* __restrict v, int64_t t0, int64_t t1, int64_t h0,
               int64_t h1, const Rope& rope) {
  constexpr int64_t W = kLane<KV>;
  const int64_t D = s.D, BS = s.BS;
  const ValueLayout layout = ValueLayoutOf<KV>(BS, D);
  for (int64_t t = t0; t < t1; ++t) {
    if (slots[t] < 0) continue;
    const int64_t block = slots[t] / BS, o = slots[t] % BS;
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t base = ((layer * s.KVH + h) * s.NB + block) * BS * D;
      const float* kt = k_new + (t * s.KVH + h) * D;
      const float* vt = v_new + (t * s.KVH + h) * D;
      if (rope.cos != nullptr) {  // the key as the step's attention saw it
        float* rotated = Filled<float>(8, D, 0.f);
        rope.Apply(kt, t, D, 1.f, rotated);
        kt = rotated;
      }
      KV* kp = k + base + KIndex(o, 0, BS, W);   // position o's lane of K row d / W: kp + (d / W) * BS * W + d % W
      for (int64_t i = 0; i < D / W; ++i)
        for (int64_t w = 0; w < W; ++w) Store(kt[i * W + w], kp + i * BS * W + w);
      for (int64_t d = 0; d < D; ++d) Store(vt[d], v + base + VIndex(o, d, D, layout));
    }
  }
}

// An item's work: its attention, then (slots not null) its tokens' K/V for its kv head into the
// pool, at once, by the thread that ran it (the pages are then still in its cache, and the writes
// are spread over the threads like the reads). No item reads a position any item writes: a row
// reads only the positions before its step's first, and the blocks its step writes are its own.
template <typename KV>
std::function<void(const Item&, const Item*)> MakeRun(const Shapes& s, const float* q, const float* k_new, const float* v_new,
                                         const KV* k, const KV* v, int64_t layer, const int32_t* tables,
                                         const int32_t* start, float* o, const int32_t* slots, KV* k_out,
                                         KV* v_out, const Rope& rope) {
  auto wrap = [&](auto kern) {
    return [kern, s, layer, k_new, v_new, slots, k_out, v_out, rope](const Item& it, const Item* next) {
      kern->Run(it, next);
      if (slots != nullptr)
        WritePool(s, layer, k_new, v_new, slots, k_out, v_out, it.t0, it.t1, it.h, it.h + 1, rope);
    };
  };
  if (s.D == 64)
    return wrap(std::make_shared<Kernel<KV, 64>>(s, q, k_new, v_new, k, v, layer, tables, start, o, rope));
  if (s.D == 128)
    return wrap(std::make_shared<Kernel<KV, 128>>(s, q, k_new, v_new, k, v, layer, tables, start, o, rope));
  return wrap(std::make_shared<Kernel<KV, 0>>(s, q, k_new, v_new, k, v, layer, tables, start, o, rope));
}

// Work shared between the calling thread and pool tasks. Held by shared_ptr: a task the pool
// starts only after the caller has finished every item finds nothing left and touches nothing
// but this.
struct Shared {
  std::vector<Item> items;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::function<void(const Item&, const Item*)> run;

  // each thread claims its next item before it runs one, so that the one can ask for the next's
  // first pages
  void Work() {
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed), j; i < n; i = j) {
      j = next.fetch_add(1, std::memory_order_relaxed);
      run(items[i], j < n ? &items[j] : nullptr);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// slots (or null): each token's flat slot in the pool, -1 for none; the step's K/V are then
// written there, into k_out and v_out (the pool's buffers, aliased), by each item after its reads.
ffi::Error Call(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer_buf,
                ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> start,
                ffi::ResultBuffer<ffi::F32> o, const ffi::Buffer<ffi::S32>* slots, void* k_out, void* v_out,
                const Rope& rope = Rope{}) {
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

  if (slots != nullptr) {
    if (slots->element_count() != static_cast<size_t>(s.T))
      return ffi::Error::InvalidArgument("cpu attention: slots must be [T], one per token");
    const int32_t* sl = slots->typed_data();
    for (int64_t t = 0; t < s.T; ++t)
      if (sl[t] < -1 || sl[t] >= s.NB * s.BS)
        return ffi::Error::InvalidArgument("cpu attention: token " + std::to_string(t) + "'s slot " +
                                           std::to_string(sl[t]) + " outside the pool [0, " +
                                           std::to_string(s.NB * s.BS) + ") (-1: none)");
  }
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
  // the most work first, so the last items to finish are short ones
  auto cost = [&](const Item& a) { return (st[a.t0] + a.t1 - a.row_first) * (a.t1 - a.t0); };
  std::stable_sort(shared->items.begin(), shared->items.end(),
                   [&](const Item& a, const Item& b) { return cost(a) > cost(b); });

  const int32_t* sl = slots != nullptr ? slots->typed_data() : nullptr;
  if (k.element_type() == ffi::DataType::F32)
    shared->run = MakeRun<float>(s, q.typed_data(), k_new.typed_data(), v_new.typed_data(), k.typed_data<float>(),
                                 v.typed_data<float>(), layer, tab, st, op, sl, static_cast<float*>(k_out),
                                 static_cast<float*>(v_out), rope);
  else
    shared->run = MakeRun<uint16_t>(s, q.typed_data(), k_new.typed_data(), v_new.typed_data(),
                                    static_cast<const uint16_t*>(k.untyped_data()),
                                    static_cast<const uint16_t*>(v.untyped_data()), layer, tab, st, op, sl,
                                    static_cast<uint16_t*>(k_out), static_cast<uint16_t*>(v_out), rope);

  const int64_t n_items = static_cast<int64_t>(shared->items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->Work(); });
  shared->Work();
  // items other threads claimed may still be running
  while (shared->done.load(std::memory_order_acquire) < n_items) std::this_thread::yield();
  // padding tokens belong to no item; one given a slot still writes there
  auto write_padding = [&](auto* kw, auto* vw) {
    for (int64_t t = 0; t < s.T; ++t)
      if (sq[t] < 0 && sl[t] >= 0) WritePool(s, layer, k_new.typed_data(), v_new.typed_data(), sl, kw, vw, t, t + 1, 0, s.KVH, rope);
  };
  if (sl != nullptr && k.element_type() == ffi::DataType::F32)
    write_padding(static_cast<float*>(k_out), static_cast<float*>(v_out));
  else if (sl != nullptr)
    write_padding(static_cast<uint16_t*>(k_out), static_cast<uint16_t*>(v_out));
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer_buf,
                ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> start,
                ffi::ResultBuffer<ffi::F32> o) {
  return Call(pool, q, k_new, v_new, k, v, layer_buf, tables, seq, start, o, nullptr, nullptr, nullptr);
}

// The same, writing the step's K/V into the pool, which it hands back as two more results that
// alias its operands: a layer's write then comes after its reads by construction, the next
// layer's call reads what it wrote, and XLA updates the donated pool in place.
ffi::Error ImplWriting(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                       ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> layer_buf,
                       ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq, ffi::Buffer<ffi::S32> start,
                       ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::F32> o, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out) {
  return Call(pool, q, k_new, v_new, k, v, layer_buf, tables, seq, start, o, &slots, k_out->untyped_data(),
              v_out->untyped_data());
}

// The same, taking q and k_new before the rotary embedding: cos, sin [T, D] rotate them (the
// pool gets the rotated keys) and q is then multiplied by `scale`. Saves the step two XLA fusions
// a layer (~3 ms at batch 32 on 2 cores).
ffi::Error ImplWritingRope(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
                           ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> seq,
                           ffi::Buffer<ffi::S32> start, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::F32> cos,
                           ffi::Buffer<ffi::F32> sin, ffi::ResultBuffer<ffi::F32> o, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out, float scale) {
  const auto qd = q.dimensions();
  const auto cd = cos.dimensions();
  if (qd.size() != 4 || cd.size() != 2 || cd[0] != qd[0] || cd[1] != qd[3] || qd[3] % 2 != 0 ||
      !std::equal(cd.begin(), cd.end(), sin.dimensions().begin(), sin.dimensions().end()))
    return ffi::Error::InvalidArgument("cpu attention: cos and sin must be [T, D] for q [T, KVH, G, D], D even");
  return Call(pool, q, k_new, v_new, k, v, layer_buf, tables, seq, start, o, &slots, k_out->untyped_data(),
              v_out->untyped_data(), Rope{cos.typed_data(), sin.typed_data(), scale});
}

// the operands both handlers take, in order
auto Inputs() {
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
      .Arg<ffi::Buffer<ffi::S32>>();  // start
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuAttention, Impl, Inputs().Ret<ffi::Buffer<ffi::F32>>() /* o */);
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuAttentionWriting, ImplWriting,
                              Inputs()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::AnyBuffer>()         // k pool
                                  .Ret<ffi::AnyBuffer>());       // v pool
XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedjaxCpuAttentionWritingRope, ImplWritingRope,
                              Inputs()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::AnyBuffer>()         // k pool
                                  .Ret<ffi::AnyBuffer>()         // v pool
                                  .Attr<float>("scale"));

// How this build lays out the values of a bfloat16 page (see the page layout above): 1 in value
// pairs, 0 in position pairs (both: rows where the pairs do not fit). For pagedjax.native.to_pages.
extern "C" int PagedjaxValuePairs() { return kBf16ValuePairs ? 1 : 0; }

// Whether this build multiplies a bfloat16 page by pair products (1) or widens it to float32 (0).
// For pagedjax.native.bf16_pair_products.
extern "C" int PagedjaxPairProducts() { return kBf16PairProducts ? 1 : 0; }
