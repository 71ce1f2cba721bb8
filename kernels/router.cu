// Router kernels: top-k with a score function (softmax pre/post, sigmoid, sqrtsoftplus; grouped top-k;
// expert bias for selection only; scaling), its backward, the dense scores for the aux loss and their
// backward, and a deterministic aux loss (forward and backward). Semantics: specs/router.md.
//
// Row kernels: a "team" of TEAM threads handles one token (TEAM = 32: one warp, 4 tokens per block;
// TEAM > 32: the whole block). The row's selection keys live in shared memory as order-preserving
// uint32 keys (NaN = largest, all NaNs equal; ties by lowest index). Selection: iterative warp argmax for
// k <= 8 (TEAM = 32), else a 4-bit radix select with private per-thread histograms (no atomics
// conflicts, no float atomics) that stops as soon as the threshold bin is taken whole. Every sum is
// done in a fixed order, so outputs are bitwise reproducible. Global traffic: logits read once, each
// output written once with 16-byte vectors (the K nonzero probs are patched in after the zero fill,
// while the lines are still in L2).
#include "moe_rt/common.cuh"

using namespace moe_rt;

#define FULL_MASK 0xffffffffu

namespace {

constexpr float kEps = 1e-20f;
constexpr int SIGMOID = 0, SOFTMAX = 1, SQRTSOFTPLUS = 2;
constexpr int kIntMax = 0x7fffffff;
#define kInf __int_as_float(0x7f800000)
template <int N> struct IC { static constexpr int value = N; };

__device__ __forceinline__ unsigned fkey(float v) {
  const unsigned b = __float_as_uint(v);
  const unsigned k = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (v != v) ? 0xffffffffu : k;
}

__device__ __forceinline__ float fdecode(unsigned k) {
  if (k == 0xffffffffu) return __uint_as_float(0x7fffffffu);
  const unsigned b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float sqrtsoftplusf(float x) { return x > 20.0f ? sqrtf(x) : sqrtf(log1pf(expf(x))); }

__device__ __forceinline__ bool selected(unsigned key, int i, unsigned thr, int ilast) {
  return key > thr || (key == thr && i <= ilast);
}

// ---- vector load/store of N elements (N * sizeof(T) in {4, 8, 16, 32, ...} bytes) ----------------------
template <int N, typename T>
__device__ __forceinline__ void ldn(const T* p, T (&v)[N]) {
  constexpr int B = N * (int)sizeof(T);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) reinterpret_cast<uint4*>(v)[i] = reinterpret_cast<const uint4*>(p)[i];
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(v) = *reinterpret_cast<const uint2*>(p);
  } else if constexpr (B == 4) {
    *reinterpret_cast<unsigned*>(v) = *reinterpret_cast<const unsigned*>(p);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = p[i];
  }
}

template <int N, typename T>
__device__ __forceinline__ void stn(T* p, const T (&v)[N]) {
  constexpr int B = N * (int)sizeof(T);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) reinterpret_cast<uint4*>(p)[i] = reinterpret_cast<const uint4*>(v)[i];
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(v);
  } else if constexpr (B == 4) {
    *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(v);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = v[i];
  }
}

// ---- team helpers ------------------------------------------------------------------------------------
template <int TEAM>
struct Team {
  static constexpr int NW = TEAM / 32;
  __device__ __forceinline__ static int rank() { return TEAM == 32 ? (int)(threadIdx.x & 31) : (int)threadIdx.x; }
  __device__ __forceinline__ static void sync() {
    if constexpr (TEAM == 32) __syncwarp(); else __syncthreads();
  }
  // Fixed-order sum / max over the team; every thread gets the result.
  __device__ __forceinline__ static float sum(float v, float* red) {
    v = warp_sum(v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
      __syncthreads();
      float t = 0.0f;
#pragma unroll
      for (int w = 0; w < NW; ++w) t += red[w];
      return t;
    }
  }
  __device__ __forceinline__ static float max(float v, float* red) {
    v = warp_max(v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
      __syncthreads();
      float t = red[0];
#pragma unroll
      for (int w = 1; w < NW; ++w) t = fmaxf(t, red[w]);
      return t;
    }
  }
  __device__ __forceinline__ static int imax(int v, int* redi) {
    v = __reduce_max_sync(FULL_MASK, v);
    if constexpr (TEAM == 32) {
      return v;
    } else {
      __syncthreads();
      if ((threadIdx.x & 31) == 0) redi[threadIdx.x >> 5] = v;
      __syncthreads();
      int t = redi[0];
#pragma unroll
      for (int w = 1; w < NW; ++w) t = t > redi[w] ? t : redi[w];
      return t;
    }
  }
  // Exclusive count of `pred` over team ranks below this one; *total = team count.
  __device__ __forceinline__ static int excl_count(bool pred, int* total, int* redi) {
    const unsigned lane = threadIdx.x & 31;
    const unsigned b = __ballot_sync(FULL_MASK, pred);
    const int wr = __popc(b & ((1u << lane) - 1u)), wt = __popc(b);
    if constexpr (TEAM == 32) {
      *total = wt;
      return wr;
    } else {
      __syncthreads();
      if (lane == 0) redi[threadIdx.x >> 5] = wt;
      __syncthreads();
      int off = 0, tot = 0;
      const int me = threadIdx.x >> 5;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const int c = redi[w];
        off += w < me ? c : 0;
        tot += c;
      }
      *total = tot;
      return off + wr;
    }
  }
};

// ---- selection -----------------------------------------------------------------------------------------
// Both return (thr, ilast): element i of keys[0, n) is selected iff selected(keys[i], i, thr, ilast), and
// exactly k elements are, the k first in the order (key desc, index asc). Requires 1 <= k <= n.

// Iterative warp argmax (TEAM = 32, small k): each lane caches its best; the winner rescans.
__device__ __forceinline__ void argmax_select(const unsigned* keys, int n, int k, unsigned& thr, int& ilast) {
  const int lane = threadIdx.x & 31;
  unsigned bk = 0;
  int bi = kIntMax;
  for (int i = lane; i < n; i += 32) {
    const unsigned key = keys[i];
    if (bi == kIntMax || key > bk) { bk = key; bi = i; }
  }
  for (int round = 0;; ++round) {
    const unsigned mk = __reduce_max_sync(FULL_MASK, bk);
    const int mi = (int)__reduce_min_sync(FULL_MASK, (unsigned)(bk == mk ? bi : kIntMax));
    if (round == k - 1) { thr = mk; ilast = mi; return; }
    if (bi == mi) {
      unsigned nk = 0;
      int ni = kIntMax;
      for (int i = lane; i < n; i += 32) {
        const unsigned key = keys[i];
        const bool after = key < mk || (key == mk && i > mi);
        if (after && (ni == kIntMax || key > nk)) { nk = key; ni = i; }
      }
      bk = nk; bi = ni;
    }
  }
}

// Radix select, 4-bit digits from the top. hist: 16 * TEAM private counters (zero on entry and exit).
template <int TEAM>
__device__ void radix_select(const unsigned* keys, int n, int k, unsigned* hist, unsigned* wcnt, int* redi,
                             unsigned& thr, int& ilast) {
  const int r = Team<TEAM>::rank(), lane = threadIdx.x & 31, warp = r >> 5;
  unsigned prefix = 0, mask = 0;
  int need = k;
  for (int shift = 28, pass = 0; shift >= 0; shift -= 4, ++pass) {
    for (int i = r; i < n; i += TEAM) {
      const unsigned key = keys[i];
      if ((key & mask) == prefix) atomicAdd(&hist[((key >> shift) & 15u) * TEAM + r], 1u);
    }
    unsigned v[16];
#pragma unroll
    for (int b = 0; b < 16; ++b) { v[b] = hist[b * TEAM + r]; hist[b * TEAM + r] = 0u; }
    // Transposed butterfly: afterwards lanes 2b and 2b+1 hold the warp's count of bin b.
#pragma unroll
    for (int w = 8, m = 16; w >= 1; w >>= 1, m >>= 1) {
      const bool up = (lane & m) != 0;
#pragma unroll
      for (int i = 0; i < w; ++i) {
        const unsigned send = up ? v[i] : v[i + w];
        const unsigned keep = up ? v[i + w] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, m);
      }
    }
    unsigned cnt = v[0] + __shfl_xor_sync(FULL_MASK, v[0], 1);
    if constexpr (TEAM > 32) {
      unsigned* wc = wcnt + (pass & 1) * Team<TEAM>::NW * 16;
      if ((lane & 1) == 0) wc[warp * 16 + (lane >> 1)] = cnt;
      __syncthreads();
      cnt = 0;
#pragma unroll
      for (int w = 0; w < Team<TEAM>::NW; ++w) cnt += wc[w * 16 + (lane >> 1)];
    }
    // Suffix sums over bins: even lane 2b: count of bins >= b; odd lane 2b+1: count of bins > b.
    unsigned s = (lane & 1) ? 0u : cnt;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned o = __shfl_down_sync(FULL_MASK, s, d);
      if (lane + d < 32) s += o;
    }
    const unsigned bal = __ballot_sync(FULL_MASK, ((lane & 1) == 0) && s >= (unsigned)need);
    const int p = 31 - __clz(bal);
    const unsigned gt = __shfl_sync(FULL_MASK, s, p + 1);
    const unsigned cb = __shfl_sync(FULL_MASK, cnt, p);
    need -= (int)gt;
    prefix |= (unsigned)(p >> 1) << shift;
    mask |= 15u << shift;
    if (cb == (unsigned)need) { thr = prefix; ilast = kIntMax; return; }
  }
  // Ties at the exact k-th key: keep the first `need` in index order.
  thr = prefix;
  int run = 0, found = -1;
  for (int base = 0; base < n; base += TEAM) {
    const int i = base + r;
    const bool pred = i < n && keys[i] == prefix;
    int tot;
    const int rk = Team<TEAM>::excl_count(pred, &tot, redi);
    if (pred && run + rk == need - 1) found = i;
    run += tot;
    if (run >= need) break;
  }
  ilast = Team<TEAM>::imax(found, redi + 16);
}

template <int TEAM>
__device__ __forceinline__ void select_topk(const unsigned* keys, int n, int k, unsigned* hist, unsigned* wcnt,
                                            int* redi, unsigned& thr, int& ilast) {
  if constexpr (TEAM == 32) {
    if (k <= 8) { argmax_select(keys, n, k, thr, ilast); return; }
  }
  radix_select<TEAM>(keys, n, k, hist, wcnt, redi, thr, ilast);
}

// ---- grouped top-k: group score = sum of the top-m selection scores of the group -----------------------
template <int MM>
__device__ __forceinline__ void insert_top(unsigned (&top)[MM], unsigned key) {
  if (key > top[MM - 1]) {
    top[MM - 1] = key;
#pragma unroll
    for (int u = MM - 1; u > 0; --u) {
      if (top[u] > top[u - 1]) { const unsigned t = top[u]; top[u] = top[u - 1]; top[u - 1] = t; }
    }
  }
}

template <int TEAM, int MM>
__device__ void group_scores_reg(const unsigned* keys, int G, int n, int m, unsigned* gkey) {
  const int r = Team<TEAM>::rank();
  if (G <= TEAM) {
    int L = 1;
    while (L < 32 && L * 2 * G <= TEAM) L *= 2;
    const int j = r / L, sub = r % L;
    const bool act = j < G;
    unsigned top[MM];
#pragma unroll
    for (int u = 0; u < MM; ++u) top[u] = 0u;  // real keys are > 0
    if (act)
      for (int e = sub; e < n; e += L) insert_top<MM>(top, keys[j * n + e]);
    for (int off = 1; off < L; off <<= 1) {
      unsigned other[MM];
#pragma unroll
      for (int u = 0; u < MM; ++u) other[u] = __shfl_xor_sync(FULL_MASK, top[u], off);
      // both lists are sorted: stop at the first key that no longer enters
#pragma unroll
      for (int u = 0; u < MM; ++u) {
        if (other[u] <= top[MM - 1]) break;
        insert_top<MM>(top, other[u]);
      }
    }
    if (act && sub == 0) {
      float s = 0.0f;
#pragma unroll
      for (int u = 0; u < MM; ++u)
        if (u < m) s += fdecode(top[u]);
      gkey[j] = fkey(s);
    }
  } else {
    for (int j = r; j < G; j += TEAM) {
      unsigned top[MM];
#pragma unroll
      for (int u = 0; u < MM; ++u) top[u] = 0u;
      for (int e = 0; e < n; ++e) insert_top<MM>(top, keys[j * n + e]);
      float s = 0.0f;
#pragma unroll
      for (int u = 0; u < MM; ++u)
        if (u < m) s += fdecode(top[u]);
      gkey[j] = fkey(s);
    }
  }
}

// Any m: one thread per group, m rounds of "next in order" (O(m * n); only for m > 8).
template <int TEAM>
__device__ void group_scores_any(const unsigned* keys, int G, int n, int m, unsigned* gkey) {
  for (int j = Team<TEAM>::rank(); j < G; j += TEAM) {
    unsigned pk = 0xffffffffu;
    int pi = -1;
    float s = 0.0f;
    for (int u = 0; u < m; ++u) {
      unsigned bk = 0;
      int bi = kIntMax;
      for (int e = 0; e < n; ++e) {
        const unsigned key = keys[j * n + e];
        const bool after = key < pk || (key == pk && e > pi);
        if (after && (bi == kIntMax || key > bk)) { bk = key; bi = e; }
      }
      s += fdecode(bk);
      pk = bk; pi = bi;
    }
    gkey[j] = fkey(s);
  }
}

template <int TEAM>
__device__ __forceinline__ void group_scores(const unsigned* keys, int G, int n, int m, unsigned* gkey) {
  if (m == 1) group_scores_reg<TEAM, 1>(keys, G, n, m, gkey);
  else if (m == 2) group_scores_reg<TEAM, 2>(keys, G, n, m, gkey);
  else if (m <= 4) group_scores_reg<TEAM, 4>(keys, G, n, m, gkey);
  else if (m <= 8) group_scores_reg<TEAM, 8>(keys, G, n, m, gkey);
  else group_scores_any<TEAM>(keys, G, n, m, gkey);
}

// ---- shared-memory layout of one token slot (in 32-bit words; mirrored in moe_rt/router.py) ----------
struct Layout {
  int keys, gkey, hist, wcnt, red, wcount, wlist, lidx, lkey, lw, lp, total;
};

__device__ __forceinline__ int al4(int x) { return (x + 3) & ~3; }

template <int TEAM>
__device__ __forceinline__ Layout slot_layout(int E, int G, int K) {
  constexpr int NW = TEAM / 32;
  Layout L;
  const int Kp = al4(K);
  L.keys = 0;
  L.gkey = L.keys + al4(E);
  L.hist = L.gkey + al4(G);
  L.wcnt = L.hist + 16 * TEAM;
  L.red = L.wcnt + 32 * NW;
  L.wcount = L.red + 64;
  L.wlist = L.wcount + 16;
  L.lidx = L.wlist + NW * Kp;
  L.lkey = L.lidx + Kp;
  L.lw = L.lkey + Kp;
  L.lp = L.lw + Kp;
  L.total = L.lp + Kp;
  return L;
}

}  // namespace

// ---- forward: top-k with score function, or (aux_mode) the dense scores for the aux loss --------------
// probs/scores/rmap/inter/topk_idx/topk_w may be null (not written). vec: all pointers 16-byte aligned
// and E % (16 / sizeof(T)) == 0. G = 0: no grouping.
template <typename T, int TEAM>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM)
router_fwd(const T* __restrict__ logits, i64 num_tokens, int E, int K, int score_fn, int pre_softmax,
           int aux_mode, int G, int g, int m, unsigned gmagic, float scale, const float* __restrict__ bias,
           T* __restrict__ probs, float* __restrict__ scores, bool* __restrict__ rmap,
           float* __restrict__ inter, int* __restrict__ topk_idx, float* __restrict__ topk_w, int vec) {
  using TM = Team<TEAM>;
  constexpr int SPB = TEAM == 32 ? 4 : 1;
  constexpr int CH = 16 / (int)sizeof(T);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM, lane = threadIdx.x & 31, warp = r >> 5;
  const Layout L = slot_layout<TEAM>(E, G, K);
  unsigned* base = reinterpret_cast<unsigned*>(smem_raw) + (size_t)slot * L.total;
  unsigned* keys = base + L.keys;
  unsigned* gkey = base + L.gkey;
  unsigned* hist = base + L.hist;
  unsigned* wcnt = base + L.wcnt;
  float* red = reinterpret_cast<float*>(base + L.red);
  int* redi = reinterpret_cast<int*>(base + L.red + 32);
  int* wcount = reinterpret_cast<int*>(base + L.wcount);
  int* wlist = reinterpret_cast<int*>(base + L.wlist);
  int* lidx = reinterpret_cast<int*>(base + L.lidx);
  unsigned* lkey = base + L.lkey;
  float* lw = reinterpret_cast<float*>(base + L.lw);
  float* lp = reinterpret_cast<float*>(base + L.lp);
#pragma unroll
  for (int b = 0; b < 16; ++b) hist[b * TEAM + r] = 0u;

  const bool sig_like = score_fn != SOFTMAX;
  const bool post = !aux_mode && score_fn == SOFTMAX && !pre_softmax;
  const bool dense_norm = aux_mode || (score_fn == SOFTMAX && pre_softmax);
  const int nch = vec ? E / CH : 0;
  const int Kp = al4(K);

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    float pmax = -kInf, psum = 0.0f;
    // Phase 1: activations, intermediate (sigmoid-like), selection keys.
    auto p1 = [&](int e, float x, float& iv) -> unsigned {
      if (score_fn == SOFTMAX) {
        pmax = fmaxf(pmax, x);
        iv = x;
        return fkey(x);
      }
      const float a = score_fn == SIGMOID ? sigmoidf(x) : sqrtsoftplusf(x);
      iv = score_fn == SIGMOID ? a : x;
      if (aux_mode) { psum += a; return fkey(a); }
      return fkey(bias ? a + bias[e] : a);
    };
    const bool write_inter1 = inter != nullptr && sig_like;
    if (vec) {
      for (int c = r; c < nch; c += TEAM) {
        alignas(16) T xv[CH];
        ldn<CH>(logits + row + (i64)c * CH, xv);
        alignas(16) unsigned kv[CH];
        alignas(16) float iv[CH];
#pragma unroll
        for (int v = 0; v < CH; ++v) kv[v] = p1(c * CH + v, to_float(xv[v]), iv[v]);
        stn<CH>(keys + c * CH, kv);
        if (write_inter1) stn<CH>(inter + row + (i64)c * CH, iv);
      }
    } else {
      for (int e = r; e < E; e += TEAM) {
        float iv;
        keys[e] = p1(e, to_float(logits[row + e]), iv);
        if (write_inter1) inter[row + e] = iv;
      }
    }
    // Dense normalization: softmax over all E (pre-softmax, aux) or v / (sum v + eps) (aux sigmoid-like).
    if (dense_norm) {
      float mul;
      if (score_fn == SOFTMAX) {
        const float M = TM::max(pmax, red);
        psum = 0.0f;
        if (vec) {
          for (int c = r; c < nch; c += TEAM) {
            alignas(16) unsigned kv[CH];
            ldn<CH>(keys + c * CH, kv);
#pragma unroll
            for (int v = 0; v < CH; ++v) {
              const float ex = expf(fdecode(kv[v]) - M);
              psum += ex;
              kv[v] = __float_as_uint(ex);
            }
            stn<CH>(keys + c * CH, kv);
          }
        } else {
          for (int e = r; e < E; e += TEAM) {
            const float ex = expf(fdecode(keys[e]) - M);
            psum += ex;
            keys[e] = __float_as_uint(ex);
          }
        }
        mul = 1.0f / TM::sum(psum, red);
      } else {
        mul = TM::sum(psum, red) + kEps;
      }
      auto p1c = [&](unsigned k) -> float {
        return score_fn == SOFTMAX ? __uint_as_float(k) * mul : fdecode(k) / mul;
      };
      float* drow = aux_mode ? scores : inter;  // dense output of the normalized scores
      const bool wi = aux_mode && score_fn == SOFTMAX && inter != nullptr;
      if (vec) {
        for (int c = r; c < nch; c += TEAM) {
          alignas(16) unsigned kv[CH];
          alignas(16) float av[CH];
          ldn<CH>(keys + c * CH, kv);
#pragma unroll
          for (int v = 0; v < CH; ++v) { av[v] = p1c(kv[v]); kv[v] = fkey(av[v]); }
          stn<CH>(keys + c * CH, kv);
          if (drow) stn<CH>(drow + row + (i64)c * CH, av);
          if (wi) stn<CH>(inter + row + (i64)c * CH, av);
        }
      } else {
        for (int e = r; e < E; e += TEAM) {
          const float a = p1c(keys[e]);
          keys[e] = fkey(a);
          if (drow) drow[row + e] = a;
          if (wi) inter[row + e] = a;
        }
      }
    }
    TM::sync();

    // Phase 2: group-limited selection mask.
    if (G > 0) {
      const int n = E / G;
      group_scores<TEAM>(keys, G, n, m, gkey);
      TM::sync();
      unsigned gthr;
      int gil;
      select_topk<TEAM>(gkey, G, g, hist, wcnt, redi, gthr, gil);
      for (int e = r; e < E; e += TEAM) {
        const int j = n == 1 ? e : (int)__umulhi((unsigned)e, gmagic);
        if (!selected(gkey[j], j, gthr, gil)) keys[e] = 0u;
      }
      TM::sync();
    }

    // Phase 3: top-k.
    unsigned thr;
    int il;
    select_topk<TEAM>(keys, E, K, hist, wcnt, redi, thr, il);

    // Phase 4: the selected experts in index order -> lidx/lkey.
    if constexpr (TEAM == 32) {
      int cnt = 0;
      for (int b0 = 0; b0 < E && cnt < K; b0 += 32) {
        const int i = b0 + lane;
        const unsigned key = i < E ? keys[i] : 0u;
        const bool pred = i < E && selected(key, i, thr, il);
        const unsigned bal = __ballot_sync(FULL_MASK, pred);
        if (pred) {
          const int pos = cnt + __popc(bal & ((1u << lane) - 1u));
          lidx[pos] = i;
          lkey[pos] = key;
        }
        cnt += __popc(bal);
      }
      __syncwarp();
    } else {
      constexpr int NW = TEAM / 32;
      const int R = ((E + NW - 1) / NW + 31) & ~31;
      const int lo = warp * R, hi = min(E, lo + R);
      int cnt = 0;
      for (int b0 = lo; b0 < hi && cnt < K; b0 += 32) {
        const int i = b0 + lane;
        const bool pred = i < hi && selected(keys[i], i, thr, il);
        const unsigned bal = __ballot_sync(FULL_MASK, pred);
        if (pred) wlist[warp * Kp + cnt + __popc(bal & ((1u << lane) - 1u))] = i;
        cnt += __popc(bal);
      }
      if (lane == 0) wcount[warp] = cnt;
      __syncthreads();
      if (r < K) {
        int j = r, w = 0;
        while (j >= wcount[w]) { j -= wcount[w]; ++w; }
        const int i = wlist[w * Kp + j];
        lidx[r] = i;
        lkey[r] = keys[i];
      }
      __syncthreads();
    }

    // Phase 5: the K weights (warp 0 of the team, two per lane, fixed order).
    if (!aux_mode && warp == 0) {
      const int j0 = lane, j1 = lane + 32;
      const bool h0 = j0 < K, h1 = j1 < K;
      const float x0 = h0 ? fdecode(lkey[j0]) : 0.0f, x1 = h1 ? fdecode(lkey[j1]) : 0.0f;
      float w0 = 0.0f, w1 = 0.0f, q0 = 0.0f, q1 = 0.0f;
      if (score_fn == SOFTMAX) {
        if (pre_softmax) {
          w0 = scale * x0; w1 = scale * x1;
        } else {
          const float mx = warp_max(fmaxf(h0 ? x0 : -kInf, h1 ? x1 : -kInf));
          const float e0 = h0 ? expf(x0 - mx) : 0.0f, e1 = h1 ? expf(x1 - mx) : 0.0f;
          const float rs = 1.0f / warp_sum(e0 + e1);
          q0 = e0 * rs; q1 = e1 * rs;
          w0 = scale * q0; w1 = scale * q1;
        }
      } else {
        const float p0 = h0 ? (bias ? x0 - bias[lidx[j0]] : x0) : 0.0f;
        const float p1v = h1 ? (bias ? x1 - bias[lidx[j1]] : x1) : 0.0f;
        if (K > 1) {
          const float den = warp_sum(p0 + p1v) + kEps;
          w0 = scale * (p0 / den); w1 = scale * (p1v / den);
        } else {
          w0 = scale * p0; w1 = scale * p1v;
        }
      }
      if (h0) { lw[j0] = w0; lp[j0] = q0; }
      if (h1) { lw[j1] = w1; lp[j1] = q1; }
      if (topk_idx) {
        if (h0) { topk_idx[t * K + j0] = lidx[j0]; topk_w[t * K + j0] = w0; }
        if (h1) { topk_idx[t * K + j1] = lidx[j1]; topk_w[t * K + j1] = w1; }
      }
    }
    TM::sync();

    // Phase 6: dense outputs: map, zero probs (-inf intermediate for post-softmax), then the K values.
    const bool wprobs = !aux_mode && probs != nullptr, winter = post && inter != nullptr;
    if (rmap || wprobs || winter) {
      if (vec) {
        for (int c = r; c < nch; c += TEAM) {
          alignas(16) unsigned kv[CH];
          ldn<CH>(keys + c * CH, kv);
          if (rmap) {
            alignas(16) bool mv[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v) mv[v] = selected(kv[v], c * CH + v, thr, il);
            stn<CH>(rmap + row + (i64)c * CH, mv);
          }
          if (wprobs) {
            alignas(16) T z[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v) z[v] = from_float<T>(0.0f);
            stn<CH>(probs + row + (i64)c * CH, z);
          }
          if (winter) {
            alignas(16) float z[CH];
#pragma unroll
            for (int v = 0; v < CH; ++v) z[v] = -kInf;
            stn<CH>(inter + row + (i64)c * CH, z);
          }
        }
      } else {
        for (int e = r; e < E; e += TEAM) {
          if (rmap) rmap[row + e] = selected(keys[e], e, thr, il);
          if (wprobs) probs[row + e] = from_float<T>(0.0f);
          if (winter) inter[row + e] = -kInf;
        }
      }
      if (wprobs || winter) {
        TM::sync();  // orders the fill before the patch (same block)
        for (int j = r; j < K; j += TEAM) {
          const int e = lidx[j];
          if (wprobs) probs[row + e] = from_float<T>(lw[j]);
          if (winter) inter[row + e] = lp[j];
        }
      }
    }
    TM::sync();
  }
}

// ---- backward of top-k (TG = TO = logits dtype) and of the aux scores (TG = float) --------------------
template <typename TG, typename TO, int TEAM>
__global__ void __launch_bounds__(TEAM == 32 ? 128 : TEAM)
router_bwd(const TG* __restrict__ grad, const bool* __restrict__ rmap, const float* __restrict__ inter,
           i64 num_tokens, int E, int K, int score_fn, int pre_softmax, int aux_mode, float scale,
           TO* __restrict__ out, int vec) {
  using TM = Team<TEAM>;
  constexpr int SPB = TEAM == 32 ? 4 : 1;
  constexpr int CH = (sizeof(TG) == 2 || sizeof(TO) == 2) ? 8 : 4;
  __shared__ float red[32];
  const int slot = threadIdx.x / TEAM, r = threadIdx.x % TEAM;
  const bool sig_like = score_fn != SOFTMAX;
  const bool normalize = aux_mode || K > 1;
  const int nch = vec ? E / CH : 0;

  for (i64 t = (i64)blockIdx.x * SPB + slot; t < num_tokens; t += (i64)gridDim.x * SPB) {
    const i64 row = t * (i64)E;
    float A = 0.0f, B = 0.0f;
    auto acc = [&](float g, bool msk, float y) {
      if (sig_like) {
        const float v = score_fn == SIGMOID ? y : sqrtsoftplusf(y);
        if (msk) { A += v; B += g * v; }
      } else if (msk) {
        A += g * y;
      }
    };
    if (vec) {
      for (int c = r; c < nch; c += TEAM) {
        alignas(16) TG gv[CH];
        alignas(16) float yv[CH];
        alignas(16) bool mv[CH];
        ldn<CH>(grad + row + (i64)c * CH, gv);
        ldn<CH>(inter + row + (i64)c * CH, yv);
        if (rmap) ldn<CH>(rmap + row + (i64)c * CH, mv);
#pragma unroll
        for (int v = 0; v < CH; ++v) acc(scale * to_float(gv[v]), rmap ? mv[v] : true, yv[v]);
      }
    } else {
      for (int e = r; e < E; e += TEAM)
        acc(scale * to_float(grad[row + e]), rmap ? rmap[row + e] : true, inter[row + e]);
    }
    A = TM::sum(A, red);
    if (sig_like) B = TM::sum(B, red);
    const float Ae = A + kEps;
    auto dx = [&](float g, bool msk, float y) -> float {
      if (sig_like) {
        if (!msk) return 0.0f;
        const float gh = normalize ? g / Ae - B / (Ae * Ae) : g;
        if (score_fn == SIGMOID) return gh * y * (1.0f - y);
        const float v = sqrtsoftplusf(y);
        return y > 20.0f ? gh / (2.0f * v + kEps) : gh * sigmoidf(y) / (2.0f * v + kEps);
      }
      if (aux_mode) return y * (g - A);
      if (pre_softmax) return y * ((msk ? g : 0.0f) - A);
      return msk ? y * (g - A) : 0.0f;
    };
    if (vec) {
      for (int c = r; c < nch; c += TEAM) {
        alignas(16) TG gv[CH];
        alignas(16) float yv[CH];
        alignas(16) bool mv[CH];
        alignas(16) TO ov[CH];
        ldn<CH>(grad + row + (i64)c * CH, gv);
        ldn<CH>(inter + row + (i64)c * CH, yv);
        if (rmap) ldn<CH>(rmap + row + (i64)c * CH, mv);
#pragma unroll
        for (int v = 0; v < CH; ++v) ov[v] = from_float<TO>(dx(scale * to_float(gv[v]), rmap ? mv[v] : true, yv[v]));
        stn<CH>(out + row + (i64)c * CH, ov);
      }
    } else {
      for (int e = r; e < E; e += TEAM)
        out[row + e] = from_float<TO>(dx(scale * to_float(grad[row + e]), rmap ? rmap[row + e] : true, inter[row + e]));
    }
  }
}

// ---- aux loss -----------------------------------------------------------------------------------------
// loss = coeff * sum_c tpe[c] * sum_r probs[r, c]. Block b sums rows [b*rpb, (b+1)*rpb) per column, dots
// with tpe and writes partial[b]; aux_loss_final adds the partials in a fixed order. No atomics.
template <typename T>
__global__ void __launch_bounds__(256)
aux_loss_partial(const T* __restrict__ probs, i64 R, int C, const float* __restrict__ tpe, i64 rpb,
                 float* __restrict__ partial, int vec) {
  __shared__ float scratch[32];
  constexpr int CHV = 16 / (int)sizeof(T);
  const int tid = threadIdx.x;
  const i64 r0 = (i64)blockIdx.x * rpb, r1 = min(R, r0 + rpb);
  float acc = 0.0f;
  auto run = [&](auto chv) {
    constexpr int CH = decltype(chv)::value;
    const int nch = C / CH;
    const int RS = nch >= 256 ? 1 : 256 / nch;
    const int rsub = tid / (nch < 256 ? nch : 256);
    if (rsub >= RS) return;
    for (int c = tid % (nch < 256 ? nch : 256); c < nch; c += 256) {
      float cs[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) cs[v] = 0.0f;
      i64 r = r0 + rsub;
      for (; r + 3 * RS < r1; r += 4 * RS) {
        alignas(16) T a[CH], b[CH], d[CH], e[CH];
        ldn<CH>(probs + r * C + (i64)c * CH, a);
        ldn<CH>(probs + (r + RS) * C + (i64)c * CH, b);
        ldn<CH>(probs + (r + 2 * RS) * C + (i64)c * CH, d);
        ldn<CH>(probs + (r + 3 * RS) * C + (i64)c * CH, e);
#pragma unroll
        for (int v = 0; v < CH; ++v)
          cs[v] += ((to_float(a[v]) + to_float(b[v])) + (to_float(d[v]) + to_float(e[v])));
      }
      for (; r < r1; r += RS) {
        alignas(16) T a[CH];
        ldn<CH>(probs + r * C + (i64)c * CH, a);
#pragma unroll
        for (int v = 0; v < CH; ++v) cs[v] += to_float(a[v]);
      }
#pragma unroll
      for (int v = 0; v < CH; ++v) acc += tpe[c * CH + v] * cs[v];
    }
  };
  if (vec) run(IC<CHV>{});
  else run(IC<1>{});
  const float s = block_sum(acc, scratch);
  if (tid == 0) partial[blockIdx.x] = s;
}

template <typename T>
__global__ void __launch_bounds__(256)
aux_loss_final(const float* __restrict__ partial, int nb, float coeff, T* __restrict__ out) {
  __shared__ float scratch[32];
  float acc = 0.0f;
  for (int i = threadIdx.x; i < nb; i += 256) acc += partial[i];
  const float s = block_sum(acc, scratch);
  if (threadIdx.x == 0) out[0] = from_float<T>(coeff * s);
}

// grad_probs[r, c] = (coeff * tpe[c]) * grad
template <typename T>
__global__ void __launch_bounds__(256)
aux_loss_bwd(const T* __restrict__ grad, const float* __restrict__ tpe, i64 R, int C, float coeff, i64 rpb,
             T* __restrict__ out, int vec) {
  const int tid = threadIdx.x;
  const float g = to_float(grad[0]);
  const i64 r0 = (i64)blockIdx.x * rpb, r1 = min(R, r0 + rpb);
  auto run = [&](auto chv) {
    constexpr int CH = decltype(chv)::value;
    const int nch = C / CH;
    const int RS = nch >= 256 ? 1 : 256 / nch;
    const int rsub = tid / (nch < 256 ? nch : 256);
    if (rsub >= RS) return;
    for (int c = tid % (nch < 256 ? nch : 256); c < nch; c += 256) {
      alignas(16) T o[CH];
#pragma unroll
      for (int v = 0; v < CH; ++v) o[v] = from_float<T>((coeff * tpe[c * CH + v]) * g);
      for (i64 r = r0 + rsub; r < r1; r += RS) stn<CH>(out + r * C + (i64)c * CH, o);
    }
  };
  if (vec) run(IC<16 / (int)sizeof(T)>{});
  else run(IC<1>{});
}
