// The Mamba-1 selective scan (S6) fused for CPUs: forward and backward, fp32.
//
// Gu & Dao 2023, Algorithm 2 and eqs. (2a), (2b), (4), with the official kernel's discretisation
// (Ā = exp(Δ A), B̄ = Δ B, Δ = softplus(δ + bias) with threshold 20); the backward is the one
// derived above ssmkit.ops.s6.SelectiveScanFn.backward. Built at first use by
// ssmkit/ops/s6_cpu.py, which sums the per-row and per-superblock partial gradients.
//
// Layouts (fp32, contiguous; time-major within a batch row, as the mixer's activations are):
//   u, delta, z, out, dout : (b, L, d)     δ before bias and softplus; z may have any batch and
//                                          time strides (its channels contiguous)
//   A                      : (d, n)        B, C: (b, L, g, n), channel c uses group c / (d / g)
//   D, bias                : (d,)          h0, h_last, dh_last, dh0: (b, d, n)
//   reset                  : (b, L) uint8, 1 where a packed sample starts (h_{t-1} is zeroed)
//   states                 : (b, K, n, d)  the state entering each chunk of T steps (K chunks)
//
// Vectorised over channels: a block of CB = NV x W consecutive channels of one group is NV
// vectors of W lanes, so Ā = exp(Δ A), the state update and y = C·h are lane-wise, with B_t[n] and
// C_t[n] broadcast (shared by a group), and no sum across lanes on the forward's critical path.
// The state of a block, n vectors, stays in L1. The backward recomputes each chunk's states from
// its entering state (saved by the forward), runs the adjoint over the chunk, and sums dB and dC
// across lanes once per chunk. Work: forward over (row, group, block); backward over (row, group,
// superblock of blocks), each superblock with its own slice of the dB, dC partial buffers.
// exp, log, softplus and sigmoid are polynomials on vectors (~1 ulp; exp as exp2 of a pre-scaled
// argument, as the CUDA kernel's exp2f).
//
// GCC / Clang vector extensions keep the code portable (AVX2, AVX-512, NEON: the compiler lowers
// W-lane vectors to what the target has); another compiler fails the build, and the caller falls
// back to the torch path.

// Only the headers used (not <torch/extension.h>, the whole C++ frontend): a third of the
// compile time. With S6_CORE_ONLY defined, only the loops compile, without torch (a benchmark
// or sanitizer build of them in seconds).
#ifndef S6_CORE_ONLY
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int W = 8;         // lanes per vector (one AVX2 register)
constexpr int NV = 2;        // vectors per block: two independent chains per step
constexpr int CB = W * NV;   // channels per block (a cache line of each row)
constexpr int PF = 4;        // steps ahead the forward prefetches its strided rows
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

typedef float V __attribute__((vector_size(W * sizeof(float))));
typedef int32_t VI __attribute__((vector_size(W * sizeof(int32_t))));

inline V splat(float x) { return V{} + x; }
inline VI splati(int32_t x) { return VI{} + x; }
inline V select(VI mask, V a, V b) { return (V)(((VI)a & mask) | ((VI)b & ~mask)); }
inline VI imin(VI a, int32_t b) { return (a & (a < splati(b))) | (splati(b) & ~(a < splati(b))); }

inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof(V)); }
// k <= W lanes from p, the rest 0 (a block's last, partial vector)
inline V load_n(const float* p, int k) {
  if (k >= W) return load(p);
  V v = V{};
  for (int i = 0; i < k; ++i) v[i] = p[i];
  return v;
}
inline void store_n(float* p, V v, int k) {
  if (k >= W) return store(p, v);
  for (int i = 0; i < k; ++i) p[i] = v[i];
}
inline float lane_sum(V v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}

// 2^x to ~1 ulp: x = i + f, |f| <= 1/2, 2^f by a degree-6 fit, 2^i into the exponent bits.
// Below -127 it is 0 (a state's decay is complete), above 127 it saturates at 2^127 2^f.
inline V exp2v(V x) {
  // round to nearest by the 1.5 * 2^23 trick, exact for |x| < 2^22
  const V fi = (x + 12582912.f) - 12582912.f;
  const V f = x - fi;
  V p = splat(1.546973198e-4f);
  p = p * f + 1.340043217e-3f;
  p = p * f + 9.618025603e-3f;
  p = p * f + 5.550327214e-2f;
  p = p * f + 2.402265121e-1f;
  p = p * f + 6.931472067e-1f;
  p = p * f + 1.0f;
  VI i = imin(__builtin_convertvector(fi, VI), 127);
  i = (i + 127) << 23;  // the exponent field of 2^i
  return select(x < splat(-127.f), V{}, p * (V)i);
}

// ln(u) for normal u >= 1: u = m 2^k with m in [sqrt(1/2), sqrt(2)), ln m = log1p(x), x = m - 1,
// as x - x^2/2 + x^3 P(x), P a degree-7 least-squares fit (relative error 1.3e-7 in fp32; no
// division)
inline V logv(V u) {
  const VI bits = (VI)u;
  const VI k = (bits - 0x3f3504f3) >> 23;  // 0x3f3504f3: sqrt(1/2)
  const V x = (V)(bits - (k << 23)) - 1.f;
  V p = splat(-0.0736286787f);
  p = p * x + 0.126203275f;
  p = p * x - 0.132021042f;
  p = p * x + 0.14227114f;
  p = p * x - 0.166213699f;
  p = p * x + 0.199998266f;
  p = p * x - 0.250008519f;
  p = p * x + 0.33333354f;
  const V x2 = x * x;
  return __builtin_convertvector(k, V) * kLn2 + (x - 0.5f * x2 + x2 * x * p);
}

// Δ = softplus(x) = ln(1 + e^x) and its derivative sigmoid(x) into dsp; above 20 Δ = x and the
// derivative 1, as torch's softplus and the CUDA kernel. ln(1 + e) is corrected for the rounding
// of 1 + e, so a tiny e^x gives e^x.
inline V softplus(V x, V* dsp) {
  const VI big = x > splat(20.f);
  const V e = exp2v(select(big, splat(20.f), x) * kLog2e);
  const V u = 1.f + e, r = 1.f / u;
  const V lp = logv(u) - ((u - 1.f) - e) * r;
  *dsp = select(big, splat(1.f), e * r);
  return select(big, x, lp);
}

inline V sigmoid(V z) { return 1.f / (1.f + exp2v(z * -kLog2e)); }

struct Scan {
  int64_t b, L, d, g, n, cpg, nblk, T, K;
  int64_t zb, zt;  // z's batch and time strides: z may be a strided view (a half of in_proj's out)
  bool softplus;
  const float *u, *delta, *A, *B, *C, *D, *z, *bias;
  const uint8_t* reset;
};

// One block: channels c0 .. c0 + cb - 1 of group gi, as NV vectors of W lanes; per-channel
// parameters transposed to (n, CB) where needed.
struct Block {
  int64_t bi, gi, c0;
  int cb;
  int lanes(int v) const { return std::max(0, std::min(W, cb - v * W)); }
};

// the offset of z's row at (row bi, step t)
inline int64_t zrow(const Scan& s, int64_t bi, int64_t t) { return bi * s.zb + t * s.zt; }

inline Block block_of(const Scan& s, int64_t bi, int64_t gi, int64_t blk) {
  const int64_t c0 = gi * s.cpg + blk * CB;
  return {bi, gi, c0, static_cast<int>(std::min<int64_t>(CB, s.cpg - blk * CB))};
}

// x[(c0 + c) * stride + j] for the block's channels c, as vectors: out[j * NV + v], 0 in the
// lanes past cb (a transpose of (cb, n) into (n, CB))
inline void gather_rows(const float* x, int64_t stride, const Block& k, int n, float scale,
                        V* out) {
  for (int j = 0; j < n; ++j) {
    for (int v = 0; v < NV; ++v) {
      V t = V{};
      for (int i = 0; i < k.lanes(v); ++i) t[i] = x[(k.c0 + v * W + i) * stride + j] * scale;
      out[j * NV + v] = t;
    }
  }
}

inline void scatter_rows(float* x, int64_t stride, const Block& k, int n, const V* in) {
  for (int j = 0; j < n; ++j)
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < k.lanes(v); ++i) x[(k.c0 + v * W + i) * stride + j] = in[j * NV + v][i];
}

// Δ and dΔ/dδ of the block at one step (row: the offset of its first channel in (b, L, d))
inline void block_dt(const Scan& s, const Block& k, int64_t row, V* dt, V* dsp) {
  for (int v = 0; v < NV; ++v) {
    const int m = k.lanes(v);
    V x = load_n(s.delta + row + v * W, m);
    if (s.bias) x += load_n(s.bias + k.c0 + v * W, m);
    if (s.softplus) {
      dt[v] = softplus(x, &dsp[v]);
    } else {
      dt[v] = x;
      dsp[v] = splat(1.f);
    }
  }
}

// ------------------------------------------------------------------------------------------------
// forward: h_t = Ā_t h_{t-1} + Δ_t x_t B_t, y_t = C_t·h_t, out_t = (y_t + D x_t) silu(z_t)
// ------------------------------------------------------------------------------------------------

void forward_block(const Scan& s, const float* h0, const Block& k, float* out, float* h_last,
                   float* states, V* h, V* A2) {
  const int n = static_cast<int>(s.n);
  gather_rows(s.A, s.n, k, n, kLog2e, A2);
  if (h0) {
    gather_rows(h0 + k.bi * s.d * s.n, s.n, k, n, 1.f, h);
  } else {
    std::fill(h, h + n * NV, V{});
  }
  V Dv[NV];
  for (int v = 0; v < NV; ++v) Dv[v] = s.D ? load_n(s.D + k.c0 + v * W, k.lanes(v)) : V{};
  for (int64_t t = 0, chunk = 0, next = 0; t < s.L; ++t) {
    if (t == next) {  // a chunk starts: keep the state entering it
      if (states) {
        for (int j = 0; j < n; ++j)
          for (int v = 0; v < NV; ++v)
            store_n(states + ((k.bi * s.K + chunk) * s.n + j) * s.d + k.c0 + v * W, h[j * NV + v],
                    k.lanes(v));
      }
      ++chunk;
      next += s.T;
    }
    if (s.reset && s.reset[k.bi * s.L + t]) std::fill(h, h + n * NV, V{});  // h_{t-1} = 0
    const int64_t row = (k.bi * s.L + t) * s.d + k.c0;
    const float* Bt = s.B + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    const float* Ct = s.C + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    if (t + PF < s.L) {  // rows of (b, L, d) are d floats apart: fetch them before they are due
      const int64_t ahead = row + PF * s.d;
      __builtin_prefetch(s.delta + ahead);
      __builtin_prefetch(s.u + ahead);
      if (s.z) __builtin_prefetch(s.z + zrow(s, k.bi, t + PF) + k.c0);
      __builtin_prefetch(out + ahead, 1);
      __builtin_prefetch(Bt + PF * s.g * s.n);
      __builtin_prefetch(Ct + PF * s.g * s.n);
    }
    V dt[NV], dsp[NV], x[NV], dtu[NV], y[NV];
    block_dt(s, k, row, dt, dsp);
    for (int v = 0; v < NV; ++v) {
      x[v] = load_n(s.u + row + v * W, k.lanes(v));
      dtu[v] = dt[v] * x[v];
      y[v] = V{};
    }
    for (int j = 0; j < n; ++j) {
      const float bj = Bt[j], cj = Ct[j];
      for (int v = 0; v < NV; ++v) {
        const V hv = exp2v(dt[v] * A2[j * NV + v]) * h[j * NV + v] + dtu[v] * bj;
        h[j * NV + v] = hv;
        y[v] += cj * hv;
      }
    }
    for (int v = 0; v < NV; ++v) {
      V o = y[v] + Dv[v] * x[v];
      if (s.z) {
        const V zz = load_n(s.z + zrow(s, k.bi, t) + k.c0 + v * W, k.lanes(v));
        o *= zz * sigmoid(zz);
      }
      store_n(out + row + v * W, o, k.lanes(v));
    }
  }
  scatter_rows(h_last + k.bi * s.d * s.n, s.n, k, n, h);
}

// ------------------------------------------------------------------------------------------------
// backward: chunk by chunk from the end, each chunk's states recomputed from its entering state;
// g_t = ∂L/∂h_t runs the adjoint recurrence g_t = C_t dy_t + Ā_{t+1} g_{t+1}
// ------------------------------------------------------------------------------------------------

struct Grads {
  const float *dout, *dh_last, *states;
  // du, ddelta, dz: (b, L, d); dA: (b, d, n), dD, dbias: (b, d) per row; dB, dC: (nsb, b, L, g, n)
  float *du, *ddelta, *dA, *dB, *dC, *dD, *dz, *dbias, *dh0;
  int64_t nsb;
};

// scratch of one superblock's work, reused chunk after chunk
struct Work {
  std::vector<V> H, Ab, dBacc, dCacc;          // (T + 1) n, T n, T n, T n vectors of a block
  std::vector<V> dt, dsp, sg, dy, x, y, ddt;  // T x NV: per step of the chunk
  std::vector<V> A2, Av, dAc;                  // n x NV: A log2 e, A, ∂L/∂A of the chunk
  Work(int64_t T, int64_t n)
      : H((T + 1) * n * NV), Ab(T * n * NV), dBacc(T * n), dCacc(T * n), dt(T * NV),
        dsp(T * NV), sg(T * NV), dy(T * NV), x(T * NV), y(T * NV), ddt(T * NV), A2(n * NV),
        Av(n * NV), dAc(n * NV) {}
};

// one block over one chunk of len steps from t0: recompute, adjoint, skip and gate.
// G, dA, dD, dbias: the block's running g (n x NV), ∂L/∂A (n x NV), ∂L/∂D, ∂L/∂bias (NV). The
// sums over steps are taken per chunk, then added to the running ones: fp32 sums of tens of
// steps, not of the whole sequence
void backward_block_chunk(const Scan& s, const Grads& o, const Block& k, int64_t chunk,
                          int64_t t0, int64_t len, Work& w, V* G, V* dA_run, V* dD_run,
                          V* dbias_run) {
  const int n = static_cast<int>(s.n);
  V* dA = w.dAc.data();
  std::fill(dA, dA + n * NV, V{});
  V dD[NV] = {}, dbias[NV] = {};
  V Dv[NV];
  for (int v = 0; v < NV; ++v) Dv[v] = s.D ? load_n(s.D + k.c0 + v * W, k.lanes(v)) : V{};
  // the chunk's per-step vectors: Δ, dΔ/dδ, x, dy = ∂L/∂y = dout silu(z)
  for (int64_t i = 0; i < len; ++i) {
    const int64_t row = (k.bi * s.L + t0 + i) * s.d + k.c0;
    block_dt(s, k, row, &w.dt[i * NV], &w.dsp[i * NV]);
    for (int v = 0; v < NV; ++v) {
      const int m = k.lanes(v);
      w.x[i * NV + v] = load_n(s.u + row + v * W, m);
      V dy = load_n(o.dout + row + v * W, m);
      if (s.z) {
        const V zz = load_n(s.z + zrow(s, k.bi, t0 + i) + k.c0 + v * W, m), sig = sigmoid(zz);
        w.sg[i * NV + v] = sig;
        dy *= zz * sig;
      }
      w.dy[i * NV + v] = dy;
    }
  }
  // recompute: H[i] = h_{t0+i-1}, Ab[i] = Ā_{t0+i} (0 where a sample starts: the reset folded into
  // Ā is exact for the forward and for every gradient), y = C·h
  for (int j = 0; j < n; ++j)
    for (int v = 0; v < NV; ++v)
      w.H[j * NV + v] =
          load_n(o.states + ((k.bi * s.K + chunk) * s.n + j) * s.d + k.c0 + v * W, k.lanes(v));
  for (int64_t i = 0; i < len; ++i) {
    const int64_t t = t0 + i;
    const float keep = s.reset && s.reset[k.bi * s.L + t] ? 0.f : 1.f;
    const float* Bt = s.B + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    const float* Ct = s.C + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    const V* hp = &w.H[i * n * NV];
    V* hn = &w.H[(i + 1) * n * NV];
    V* ab = &w.Ab[i * n * NV];
    V dt[NV], dtu[NV], y[NV];
    for (int v = 0; v < NV; ++v) {
      dt[v] = w.dt[i * NV + v];
      dtu[v] = dt[v] * w.x[i * NV + v];
      y[v] = V{};
    }
    for (int j = 0; j < n; ++j) {
      const float bj = Bt[j], cj = Ct[j];
      for (int v = 0; v < NV; ++v) {
        const V a = exp2v(dt[v] * w.A2[j * NV + v]) * keep;
        ab[j * NV + v] = a;
        const V hv = a * hp[j * NV + v] + dtu[v] * bj;
        hn[j * NV + v] = hv;
        y[v] += cj * hv;
      }
    }
    for (int v = 0; v < NV; ++v) w.y[i * NV + v] = y[v];
  }
  // the adjoint, backward in time over the chunk
  for (int64_t i = len - 1; i >= 0; --i) {
    const int64_t t = t0 + i;
    const float* Bt = s.B + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    const float* Ct = s.C + ((k.bi * s.L + t) * s.g + k.gi) * s.n;
    const V* hp = &w.H[i * n * NV];
    const V* hn = &w.H[(i + 1) * n * NV];
    const V* ab = &w.Ab[i * n * NV];
    V* dBi = &w.dBacc[i * n];
    V* dCi = &w.dCacc[i * n];
    V dt[NV], dtu[NV], dy[NV], dbx[NV], dda[NV];
    for (int v = 0; v < NV; ++v) {
      dt[v] = w.dt[i * NV + v];
      dtu[v] = dt[v] * w.x[i * NV + v];
      dy[v] = w.dy[i * NV + v];
      dbx[v] = V{};
      dda[v] = V{};
    }
    for (int j = 0; j < n; ++j) {
      const float bj = Bt[j], cj = Ct[j];
      V dB = dBi[j], dC = dCi[j];
      for (int v = 0; v < NV; ++v) {
        const int q = j * NV + v;
        const V gv = G[q] + cj * dy[v];             // ∂L/∂h_t
        dC += hn[q] * dy[v];                        // ∂L/∂C_t = Σ_c h_t dy_t (lanes summed later)
        dB += gv * dtu[v];                          // ∂L/∂B_t = Σ_c g_t Δ_t x_t
        dbx[v] += gv * bj;                          // ∂L/∂(Δ_t x_t) = Σ_n g_t B_t
        const V dDeltaA = gv * hp[q] * ab[q];       // ∂L/∂(Δ_t A), as ∂Ā/∂(ΔA) = Ā
        dA[q] += dDeltaA * dt[v];
        dda[v] += dDeltaA * w.Av[q];
        G[q] = gv * ab[q];  // Ā_t g_t: into step t - 1
      }
      dBi[j] = dB;
      dCi[j] = dC;
    }
    for (int v = 0; v < NV; ++v) {
      w.ddt[i * NV + v] = dda[v] + dbx[v] * w.x[i * NV + v];  // ∂L/∂Δ_t
      store_n(o.du + (k.bi * s.L + t) * s.d + k.c0 + v * W, dbx[v] * dt[v], k.lanes(v));
    }
  }
  // Δ's input, the skip and the gate: dδ = dΔ softplus'(δ + bias), du += D dy, dD = Σ dy x,
  // dz = dout pre silu'(z) with pre = y + D x
  for (int64_t i = 0; i < len; ++i) {
    const int64_t row = (k.bi * s.L + t0 + i) * s.d + k.c0;
    for (int v = 0; v < NV; ++v) {
      const int m = k.lanes(v), q = i * NV + v;
      const V ddelta = w.ddt[q] * w.dsp[q];
      store_n(o.ddelta + row + v * W, ddelta, m);
      dbias[v] += ddelta;
      const V xv = w.x[q], dyv = w.dy[q];
      if (s.D) {
        store_n(o.du + row + v * W, load_n(o.du + row + v * W, m) + Dv[v] * dyv, m);
        dD[v] += dyv * xv;
      }
      if (s.z) {
        const V zz = load_n(s.z + zrow(s, k.bi, t0 + i) + k.c0 + v * W, m), sig = w.sg[q];
        const V pre = w.y[q] + Dv[v] * xv;
        const V dz = load_n(o.dout + row + v * W, m) * pre * sig * (1.f + zz * (1.f - sig));
        store_n(o.dz + row + v * W, dz, m);
      }
    }
  }
  for (int q = 0; q < n * NV; ++q) dA_run[q] += dA[q];
  for (int v = 0; v < NV; ++v) {
    dD_run[v] += dD[v];
    dbias_run[v] += dbias[v];
  }
}

void backward_superblock(const Scan& s, const Grads& o, int64_t bi, int64_t gi, int64_t sb) {
  const int n = static_cast<int>(s.n);
  const int64_t b0 = s.nblk * sb / o.nsb, b1 = s.nblk * (sb + 1) / o.nsb;  // its blocks
  const int64_t nb = b1 - b0;
  Work w(s.T, n);
  std::vector<V> G(nb * n * NV), dA(nb * n * NV, V{}), dD(nb * NV, V{}), dbias(nb * NV, V{});
  for (int64_t q = 0; q < nb; ++q)
    gather_rows(o.dh_last + bi * s.d * s.n, s.n, block_of(s, bi, gi, b0 + q), n, 1.f,
                &G[q * n * NV]);
  float* dBp = o.dB + ((sb * s.b + bi) * s.L * s.g + gi) * s.n;  // this superblock's slice
  float* dCp = o.dC + ((sb * s.b + bi) * s.L * s.g + gi) * s.n;
  for (int64_t chunk = s.K - 1; chunk >= 0; --chunk) {
    const int64_t t0 = chunk * s.T, len = std::min(s.T, s.L - t0);
    std::fill(w.dBacc.begin(), w.dBacc.begin() + len * n, V{});
    std::fill(w.dCacc.begin(), w.dCacc.begin() + len * n, V{});
    for (int64_t q = 0; q < nb; ++q) {
      const Block k = block_of(s, bi, gi, b0 + q);
      gather_rows(s.A, s.n, k, n, kLog2e, w.A2.data());
      gather_rows(s.A, s.n, k, n, 1.f, w.Av.data());
      backward_block_chunk(s, o, k, chunk, t0, len, w, &G[q * n * NV], &dA[q * n * NV],
                           &dD[q * NV], &dbias[q * NV]);
    }
    for (int64_t i = 0; i < len; ++i) {  // dB, dC: the sum over the lanes (channels)
      for (int j = 0; j < n; ++j) {
        dBp[(t0 + i) * s.g * s.n + j] = lane_sum(w.dBacc[i * n + j]);
        dCp[(t0 + i) * s.g * s.n + j] = lane_sum(w.dCacc[i * n + j]);
      }
    }
  }
  for (int64_t q = 0; q < nb; ++q) {
    const Block k = block_of(s, bi, gi, b0 + q);
    scatter_rows(o.dh0 + bi * s.d * s.n, s.n, k, n, &G[q * n * NV]);
    scatter_rows(o.dA + bi * s.d * s.n, s.n, k, n, &dA[q * n * NV]);
    for (int v = 0; v < NV; ++v) {
      store_n(o.dD + bi * s.d + k.c0 + v * W, dD[q * NV + v], k.lanes(v));
      store_n(o.dbias + bi * s.d + k.c0 + v * W, dbias[q * NV + v], k.lanes(v));
    }
  }
}

#ifndef S6_CORE_ONLY
Scan make_scan(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
               const at::Tensor& B, const at::Tensor& C, const std::optional<at::Tensor>& D,
               const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& bias,
               const std::optional<at::Tensor>& reset, bool softplus, int64_t T) {
  for (const auto* t : {&u, &delta, &A, &B, &C}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                "selective_scan_cpu: inputs must be contiguous fp32 CPU tensors");
  }
  Scan s{};
  s.b = u.size(0);
  s.L = u.size(1);
  s.d = u.size(2);
  s.g = B.size(2);
  s.n = A.size(1);
  // the shapes every loop relies on (the Python side checks them first, with better words)
  auto is = [](const at::Tensor& t, std::initializer_list<int64_t> shape) {
    return t.sizes().equals(shape);
  };
  TORCH_CHECK(u.dim() == 3 && is(delta, {s.b, s.L, s.d}) && A.dim() == 2 && A.size(0) == s.d &&
                  B.dim() == 4 && s.g > 0 && s.d % s.g == 0 && is(B, {s.b, s.L, s.g, s.n}) &&
                  is(C, {s.b, s.L, s.g, s.n}) && T > 0,
              "selective_scan_cpu: u, delta (b, L, d), A (d, n), B, C (b, L, g, n) expected");
  for (const auto* t : {&D, &bias}) {
    TORCH_CHECK(!*t || ((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() &&
                        is(**t, {s.d})),
                "selective_scan_cpu: D and delta_bias must be contiguous fp32 (d,)");
  }
  TORCH_CHECK(!reset || (reset->scalar_type() == at::kByte && reset->is_contiguous() &&
                         is(*reset, {s.b, s.L})),
              "selective_scan_cpu: reset must be contiguous uint8 (b, L)");
  s.cpg = s.d / s.g;
  s.nblk = (s.cpg + CB - 1) / CB;
  s.T = T;
  s.K = (s.L + T - 1) / T;
  s.softplus = softplus;
  s.u = u.data_ptr<float>();
  s.delta = delta.data_ptr<float>();
  s.A = A.data_ptr<float>();
  s.B = B.data_ptr<float>();
  s.C = C.data_ptr<float>();
  s.D = D ? D->data_ptr<float>() : nullptr;
  s.z = z ? z->data_ptr<float>() : nullptr;
  if (z) {
    TORCH_CHECK(z->scalar_type() == at::kFloat && z->dim() == 3 && z->size(0) == s.b &&
                    z->size(1) == s.L && z->size(2) == s.d && z->stride(2) == 1,
                "selective_scan_cpu: z must be fp32 (b, L, d) with contiguous channels");
    s.zb = z->stride(0);
    s.zt = z->stride(1);
  }
  s.bias = bias ? bias->data_ptr<float>() : nullptr;
  s.reset = reset ? reset->data_ptr<uint8_t>() : nullptr;
  return s;
}

std::vector<at::Tensor> forward(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                const at::Tensor& B, const at::Tensor& C,
                                const std::optional<at::Tensor>& D,
                                const std::optional<at::Tensor>& z,
                                const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& h0,
                                const std::optional<at::Tensor>& reset, bool softplus, int64_t T,
                                bool save_states) {
  const Scan s = make_scan(u, delta, A, B, C, D, z, bias, reset, softplus, T);
  TORCH_CHECK(!h0 || (h0->scalar_type() == at::kFloat && h0->is_contiguous() &&
                      h0->sizes().equals({s.b, s.d, s.n})),
              "selective_scan_cpu: h0 must be contiguous fp32 (b, d, n)");
  const float* h0_p = h0 ? h0->data_ptr<float>() : nullptr;
  auto out = at::empty_like(u);
  auto h_last = at::empty({s.b, s.d, s.n}, u.options());
  auto states = save_states ? at::empty({s.b, s.K, s.n, s.d}, u.options()) : at::Tensor();
  float* out_p = out.data_ptr<float>();
  float* h_p = h_last.data_ptr<float>();
  float* st_p = save_states ? states.data_ptr<float>() : nullptr;
  at::parallel_for(0, s.b * s.g * s.nblk, 1, [&](int64_t begin, int64_t end) {
    std::vector<V> h(s.n * NV), A2(s.n * NV);
    for (int64_t i = begin; i < end; ++i) {
      const Block k = block_of(s, i / (s.g * s.nblk), i / s.nblk % s.g, i % s.nblk);
      forward_block(s, h0_p, k, out_p, h_p, st_p, h.data(), A2.data());
    }
  });
  return {out, h_last, states};
}

std::vector<at::Tensor> backward(const at::Tensor& u, const at::Tensor& delta, const at::Tensor& A,
                                 const at::Tensor& B, const at::Tensor& C,
                                 const std::optional<at::Tensor>& D,
                                 const std::optional<at::Tensor>& z,
                                 const std::optional<at::Tensor>& bias,
                                 const std::optional<at::Tensor>& reset, bool softplus,
                                 const at::Tensor& states, const at::Tensor& dout,
                                 const at::Tensor& dh_last, int64_t T) {
  const Scan s = make_scan(u, delta, A, B, C, D, z, bias, reset, softplus, T);
  for (const auto* t : {&states, &dout, &dh_last}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(),
                "selective_scan_cpu: states and gradients must be contiguous fp32");
  }
  TORCH_CHECK(states.sizes().equals({s.b, s.K, s.n, s.d}) && dout.sizes().equals(u.sizes()) &&
                  dh_last.sizes().equals({s.b, s.d, s.n}),
              "selective_scan_cpu: states (b, K, n, d), dout (b, L, d), dh_last (b, d, n) expected");
  // superblocks: one work unit per thread at least (at::parallel_for splits the units into one
  // contiguous range per thread), as few as that allows: each sums its dB, dC across lanes once per
  // chunk, into its own partial (at most one per n channels: the partials stay within u's size)
  const int64_t threads = at::get_num_threads();
  const int64_t want = (threads + s.b * s.g - 1) / (s.b * s.g);
  const int64_t nsb = std::max<int64_t>(
      1, std::min({want, s.nblk, std::max<int64_t>(1, s.cpg / std::max<int64_t>(s.n, 1))}));
  auto opts = u.options();
  auto du = at::empty_like(u), ddelta = at::empty_like(u);
  auto dz = z ? at::empty_like(u) : at::Tensor();
  auto dA = at::empty({s.b, s.d, s.n}, opts);
  auto dD = at::empty({s.b, s.d}, opts), dbias = at::empty({s.b, s.d}, opts);
  auto dB = at::empty({nsb, s.b, s.L, s.g, s.n}, opts);
  auto dC = at::empty({nsb, s.b, s.L, s.g, s.n}, opts);
  auto dh0 = at::empty({s.b, s.d, s.n}, opts);
  const Grads o{dout.data_ptr<float>(),
                dh_last.data_ptr<float>(),
                states.data_ptr<float>(),
                du.data_ptr<float>(),
                ddelta.data_ptr<float>(),
                dA.data_ptr<float>(),
                dB.data_ptr<float>(),
                dC.data_ptr<float>(),
                dD.data_ptr<float>(),
                z ? dz.data_ptr<float>() : nullptr,
                dbias.data_ptr<float>(),
                dh0.data_ptr<float>(),
                nsb};
  at::parallel_for(0, s.b * s.g * nsb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      backward_superblock(s, o, i / (s.g * nsb), i / nsb % s.g, i % nsb);
  });
  return {du, ddelta, dA, dB, dC, dD, dz, dbias, dh0};
}
#endif

}  // namespace

#ifndef S6_CORE_ONLY
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "S6 forward: out, h_last, states",
        py::call_guard<py::gil_scoped_release>());
  m.def("backward", &backward,
        "S6 backward: du, ddelta, dA, dB, dC, dD (per row), dz, dbias (per row), dh0",
        py::call_guard<py::gil_scoped_release>());
}
#endif
