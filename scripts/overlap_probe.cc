// Can a decode step hide its KV reads behind its matmuls on this CPU?
//
// A long-context decode step on a CPU spends its time in two kinds of work: the projections and
// MLP, bound by the cores' fused multiply-adds (a few rows times every weight), and the attention
// over the cached context, bound by reading the pool's pages from memory. The matmuls leave the
// memory nearly idle, so a matmul that asked for the next layer's pages as it went (software
// prefetches between its blocks) would, if the two overlapped, leave the attention reading from
// cache. This probe measures whether they overlap here, without the engine: two threads run, per
// layer, a compute phase (the native matmul's inner loop: 11 rows x 32 outputs of float32 sums,
// 64 inputs a pass) and then an attention phase (every line of the layer's K and V pages of every
// sequence, in a scattered block order, read once with three bf16 pair products a line, the next
// page but one asked for ahead as the real kernel does).
//
//   mode 0: the compute phase asks for nothing (today's step)
//   mode 1: the compute phase asks for every line of the coming attention's pages, a share
//           after each pass
//   mode 2: the same, one line in 8 (the rest left to the hardware prefetcher within a page)
//
// Built and run by scripts/bench_overlap.py; prints milliseconds per step of 30 layers.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

struct Config {
  int mode, passes, batch, context, layers, kv_heads, reps;
};

constexpr int kBlock = 16;                    // positions a page
constexpr int kPageBytes = kBlock * 64 * 2;   // bf16, head dim 64
constexpr int kLines = kPageBytes / 64;       // 64-byte lines a page of K (and of V)
constexpr int kThreads = 2;

std::atomic<int> arrived{0};

void Barrier(int& phase) {
  ++phase;
  arrived.fetch_add(1);
  while (arrived.load() < phase * kThreads) _mm_pause();
}

// one pass of the matmul's block: 11 rows x 32 outputs over 64 inputs, sums added into y
void Pass(const float* w, const float* x, float* y) {
  __m512 acc[22];
#pragma GCC unroll 22
  for (int r = 0; r < 22; ++r) acc[r] = _mm512_setzero_ps();
  for (int k = 0; k < 64; ++k) {
    const __m512 lo = _mm512_loadu_ps(w + k * 32), hi = _mm512_loadu_ps(w + k * 32 + 16);
#pragma GCC unroll 11
    for (int r = 0; r < 11; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * 64 + k]);
      acc[2 * r] = _mm512_fmadd_ps(xv, lo, acc[2 * r]);
      acc[2 * r + 1] = _mm512_fmadd_ps(xv, hi, acc[2 * r + 1]);
    }
  }
#pragma GCC unroll 22
  for (int r = 0; r < 22; ++r) _mm512_store_ps(y + 16 * r, _mm512_add_ps(_mm512_load_ps(y + 16 * r), acc[r]));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s mode passes batch context layers kv_heads reps\n", argv[0]);
    return 2;
  }
  const Config c{atoi(argv[1]), atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7])};
  const int pages = (c.context + kBlock - 1) / kBlock;  // a sequence's, per layer and kv head
  const int64_t blocks = int64_t(c.batch) * pages + 1;
  const size_t pool_bytes = size_t(c.layers) * c.kv_heads * blocks * kPageBytes;
  char* K = static_cast<char*>(std::aligned_alloc(4096, pool_bytes));
  char* V = static_cast<char*>(std::aligned_alloc(4096, pool_bytes));
  std::memset(K, 1, pool_bytes);
  std::memset(V, 1, pool_bytes);
  std::vector<int> table(int64_t(c.batch) * pages);  // scattered: a long-running server's pool
  for (size_t i = 0; i < table.size(); ++i) table[i] = int(i) + 1;
  std::shuffle(table.begin(), table.end(), std::mt19937(0));

  alignas(64) float w[64 * 32], x[11 * 64];
  for (int i = 0; i < 64 * 32; ++i) w[i] = 1e-3f * i;
  for (int i = 0; i < 11 * 64; ++i) x[i] = 0.5f;
  double compute_s[kThreads] = {}, attend_s[kThreads] = {};
  float sink[kThreads] = {};

  auto worker = [&](int tid) {
    int phase = 0;
    alignas(64) float y[22 * 16] = {};
    // this thread's half of a layer's pages: (kv head, sequence) pairs, each page's K then V lines
    const int64_t units = int64_t(c.kv_heads) * c.batch;
    const int64_t u0 = tid * units / kThreads, u1 = (tid + 1) * units / kThreads;
    std::vector<const char*> page_k;  // the K page of each of this thread's pages, in order
    const int64_t v_offset = V - K;
    for (int rep = 0; rep <= c.reps; ++rep) {  // rep 0 warms up
      for (int l = 0; l < c.layers; ++l) {
        page_k.clear();
        for (int64_t u = u0; u < u1; ++u) {
          const int h = int(u / c.batch), s = int(u % c.batch);
          for (int p = 0; p < pages; ++p)
            page_k.push_back(K + ((int64_t(l) * c.kv_heads + h) * blocks + table[int64_t(s) * pages + p]) * kPageBytes);
        }
        Barrier(phase);
        const auto t0 = std::chrono::steady_clock::now();
        // the compute phase, asking for this layer's pages (the attention after it) in mode 1, 2
        const int stride = c.mode == 2 ? 8 : 1;
        const int64_t lines = int64_t(page_k.size()) * 2 * kLines;
        const int64_t per_pass = c.mode == 0 ? 0 : (lines + c.passes - 1) / c.passes;
        int64_t line = 0;
        for (int it = 0; it < c.passes; ++it) {
          Pass(w, x, y);
          asm volatile("" : : "r"(w), "r"(x) : "memory");  // w and x may have changed: no pass is hoisted
          for (int64_t q = 0; q < per_pass && line < lines; q += stride, line += stride) {
            const int64_t in_page = line % (2 * kLines);
            const char* page = page_k[line / (2 * kLines)] + (in_page >= kLines ? v_offset : 0);
            _mm_prefetch(page + (in_page % kLines) * 64, _MM_HINT_T1);
          }
        }
        const auto t1 = std::chrono::steady_clock::now();
        Barrier(phase);
        const auto t2 = std::chrono::steady_clock::now();
        // the attention phase: every line of the pages, three pair products a line
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0;
        const __m512i ones = _mm512_set1_epi32(0x3f803f80);
        const __m512bh q = reinterpret_cast<const __m512bh&>(ones);
        for (size_t p = 0; p < page_k.size(); ++p) {
          if (p + 2 < page_k.size() && page_k.size() > 0)
            for (int b = 0; b < kPageBytes; b += 64) {
              _mm_prefetch(page_k[p + 2] + b, _MM_HINT_T1);
              _mm_prefetch(page_k[p + 2] + v_offset + b, _MM_HINT_T1);
            }
          for (int b = 0; b < kPageBytes; b += 64) {
            const __m512i kx = _mm512_loadu_si512(page_k[p] + b), vx = _mm512_loadu_si512(page_k[p] + v_offset + b);
            const __m512bh kb = reinterpret_cast<const __m512bh&>(kx), vb = reinterpret_cast<const __m512bh&>(vx);
            a0 = _mm512_dpbf16_ps(a0, kb, q);
            a1 = _mm512_dpbf16_ps(a1, kb, q);
            a2 = _mm512_dpbf16_ps(a2, kb, q);
            a0 = _mm512_dpbf16_ps(a0, vb, q);
            a1 = _mm512_dpbf16_ps(a1, vb, q);
            a2 = _mm512_dpbf16_ps(a2, vb, q);
          }
        }
        sink[tid] += _mm512_reduce_add_ps(_mm512_add_ps(a0, _mm512_add_ps(a1, a2)));
        const auto t3 = std::chrono::steady_clock::now();
        if (rep > 0) {
          compute_s[tid] += std::chrono::duration<double>(t1 - t0).count();
          attend_s[tid] += std::chrono::duration<double>(t3 - t2).count();
        }
      }
    }
    for (float v : y) sink[tid] += v;  // every output used: the compiler keeps every sum
  };
  std::thread helper(worker, 1);
  worker(0);
  helper.join();
  // the slower thread's time is the step's
  const double compute = std::max(compute_s[0], compute_s[1]) / c.reps * 1e3;
  const double attend = std::max(attend_s[0], attend_s[1]) / c.reps * 1e3;
  std::printf("%.4f %.4f %g\n", compute, attend, double(sink[0] + sink[1]) * 0);
  return 0;
}
