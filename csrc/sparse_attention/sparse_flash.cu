// Fused block-sparse attention on CUDA ([Note: fused block-sparse attention]).
//
// [Note: fused block-sparse attention]
// SparseSelfAttention without rpe or an attention mask as three kernels that never write the
// scores (the unfused ops write the scores, the probabilities and their gradients, each
// batch * nnz * block^2): the forward; dK and dV by key tile; dQ by query tile, so nothing
// needs atomics.
// - Tiles are 64 queries by 64 keys. A layout block of 64 is one tile, one of 128 four; finer
//   blocks share tiles ([Note: fused tile masks]). The forward and dQ walk a query tile's
//   layout row (row_ptr), dK/dV a key tile's column (col_ptr).
// - A thread block is 4 warps, and each warp owns 16 rows of every tile it computes: queries in
//   the forward and dQ, keys in dK/dV. The products run on tensor cores with fp32 accumulators.
// - The forward keeps them in registers (mma.sync m16n8k16, FlashAttention-2 style): Q, the
//   scores, the probabilities and the output never touch shared memory, which only holds K and
//   V, fetched with cp.async into two stages so the next tile loads while this one computes.
// - The backward does the same. dQ keeps the warp's Q, dO, their lse and dvec and dQ in
//   registers and streams K and V; dK/dV keeps K, V, dK and dV and streams Q, dO and the query
//   tile's lse and dvec (at D = 128 V stays in shared memory instead: its fragments do not fit
//   in 255 registers beside dK and dV). Both work 16 keys (queries) at a time, so S, dP, P and
//   dS never exceed a 16 x 16 slice per warp, and P and dS become A fragments where computed.
// - Scores are kept in log2 units (scale * log2(e) folded in). The forward keeps a running max
//   and sum per query (online softmax), rescales its fp32 output rows by exp2(old - new max),
//   and saves each query's log2-sum-exp; the backward recomputes P = exp2(S - lse) from it.
// - dS = P (dP - rowsum(dO * O)) is rounded to 16 bits before its products, as P is before PV
//   (as in FlashAttention).
//
// [Note: fused tile masks]
// Layout blocks of 16 and 32 run on the same 64 x 64 tiles: the layout is made coarse (a tile is in
// the table when any of its blocks is) and each tile carries 16 bits, one per 16 x 16 sub-block. A
// warp's 16 rows are one sub-block row and the kernels step 16 columns at a time, so a cleared bit
// skips that step's products outright and its scores are -inf (the forward) or its probabilities 0
// (the backward): exact, and what is skipped costs nothing but the tile's loads. A length that
// leaves the last tile partial comes padded (by ops/sparse_attention/fused.py) with sub-blocks
// whose bits are clear: padded rows then see only skipped steps and give zeros. A key padding mask
// is a per-key bias added to the scaled scores in all three kernels (the forward's lse includes it,
// so the backward's P does too); finite biases come floored at -1e4 ([Note: additive mask floor] in
// ops/sparse_attention), so their log2 units cannot overflow and lse keeps the digits of its sum.
// Either lets a row of a tile, or a whole query row, see only -inf: the online softmax then takes 0
// as its max (no -inf - -inf), and a row with no key left gives zeros, as the unfused softmax does.
// Kernels without either (kExtra false) are compiled apart and unchanged.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_convert.cuh"
#include "sparse_flash_cuda.h"

namespace ds {
namespace {

using cvt::to_float;

constexpr int kT = 64;  // tile side: queries and keys
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory: 16-bit rows padded by 16 bytes against bank conflicts (the 8 rows an ldmatrix
// reads at once start 16 bytes apart modulo 128).
template <typename T, int D>
struct Ld {
  static constexpr int kTile = D + 8;  // a 64 x D tile of T
  static constexpr size_t kTileBytes = sizeof(T) * kT * kTile;
  static constexpr size_t kFwd = 4 * kTileBytes;   // two stages of K and V (Q borrows one)
  static constexpr size_t kBwdQ = 4 * kTileBytes;  // the same (Q and dO borrow one)
  // Two stages of Q, dO and the query tile's lse and dvec (K and V borrow one); at D = 128
  // V's A fragments do not fit in registers beside the rest, so V keeps a tile of its own.
  static constexpr bool kBwdKVRegs = D == 64;
  static constexpr size_t kBwdKV =
      4 * kTileBytes + 2 * 2 * sizeof(float) * kT + (kBwdKVRegs ? 0 : kTileBytes);
};

__device__ __forceinline__ float warp_sum(float x) {
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// Which tiles a layout block holds: tile t of a side lies in layout block t / sub.
struct Tiling {
  int64_t bh, h, seq;
  int sub;
  __device__ explicit Tiling(const BlockLut& L) {
    bh = blockIdx.y;
    h = bh % L.heads;
    seq = L.nb * L.block;
    sub = static_cast<int>(L.block / kT);
  }
};

// Register-level tensor-core pieces of the kernels (sm_80+). The fragment layouts they rely on
// (PTX ISA: "Matrix Fragments for mma.m16n8k16 with floating point type" and "Warp-level matrix
// load instruction: ldmatrix"), with gr = lane / 4 and gc = lane % 4, "(row, columns)":
// - A, 16 x 16 row-major, four b32 of two 16-bit values, the lower column in the low half:
//   a[0] = (gr, 2gc..2gc+1), a[1] = (gr + 8, 2gc..), a[2] = (gr, 2gc + 8..),
//   a[3] = (gr + 8, 2gc + 8..).
// - B, 16 x 8 "col", two b32: b[0] = (rows 2gc..2gc+1, column gr), b[1] = (rows 2gc + 8..,
//   column gr), the lower row in the low half.
// - C/D, 16 x 8 fp32: c[0], c[1] = (gr, 2gc), (gr, 2gc + 1); c[2], c[3] = the same in row gr + 8.
// - ldmatrix .m8n8 .b16: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i, and
//   register i of lane l receives row l / 4, columns 2 (l % 4)..+1 of matrix i. With .trans
//   the matrix is read column-major: register i receives column l / 4, rows 2 (l % 4)..+1 of
//   matrix i as stored.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers (.cg: cached in L2 only).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

// 4 bytes global -> shared (.ca: .cg takes 16 only), for fp32 rows aligned to 4 bytes only.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(dst)), "l"(src)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Starts dst[64][D + 8] = the 64 contiguous rows of D elements at src; lands at a wait.
template <typename T, int D>
__device__ __forceinline__ void cp_tile(T* dst, const T* src) {
  constexpr int kVec = 16 / sizeof(T), kPerRow = D / kVec, kPerThread = kT * kPerRow / kThreads;
  static_assert(kT * kPerRow % kThreads == 0, "a tile is a whole number of rounds");
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int e = static_cast<int>(threadIdx.x) + i * kThreads;
    const int r = e / kPerRow, c = (e % kPerRow) * kVec;
    cp_async16(dst + r * Ld<T, D>::kTile + c, src + static_cast<int64_t>(r) * D + c);
  }
}

// Key tile i of a query tile's layout row (row_ptr entry e0 on), in row_ptr order: tile i % sub
// of the row's (i / sub)-th layout block, as an element offset in k and v.
template <int D>
__device__ __forceinline__ int64_t row_tile(const BlockLut& L, int32_t e0, int sub, int64_t base,
                                            int i) {
  const int64_t c = L.blocks[3 * static_cast<int64_t>(L.row_idx[e0 + i / sub]) + 2];
  return base + (c * sub + i % sub) * kT * D;
}

// The top of every kernel's walk over its n tiles, before tile i: once every warp is done with
// the other stage (tile i - 1's), tile i + 1 starts into it, and tile i is waited for. The
// commit is made even when nothing was fetched, so that wait_group 1 always means tile i.
// `next` holds tile i + 1's offset, looked up a tile ahead so those loads overlap the math.
// Returns tile i's stage.
template <typename Fetch, typename At>
__device__ __forceinline__ int advance_stage(int i, int n, int64_t& next, Fetch&& fetch,
                                             At&& tile_at) {
  const int st = i & 1;
  __syncthreads();
  if (i + 1 < n) fetch(next, st ^ 1);
  cp_async_commit();
  if (i + 2 < n) next = tile_at(i + 2);
  cp_async_wait<1>();
  __syncthreads();
  return st;
}

// What the forward and dQ share: a query tile (blockIdx.x) walking its layout row, K and V
// coming through two shared-memory stages (stage s: K at k_at(s), V after it), and what a
// tile mask and key bias say of key tile i ([Note: fused tile masks]).
template <typename T, int D>
struct RowWalk {
  static constexpr int kTileElems = kT * Ld<T, D>::kTile;
  T* const kv;
  const Tiling g;
  const int64_t t, base;
  int32_t e0;
  int n;  // key tiles of the layout row
  __device__ RowWalk(const BlockLut& L, unsigned char* smem)
      : kv(reinterpret_cast<T*>(smem)), g(L), t(blockIdx.x), base(g.bh * g.seq * D) {
    const int64_t key = g.h * L.nb + t / g.sub;
    e0 = L.row_ptr[key];
    n = (L.row_ptr[key + 1] - e0) * g.sub;
  }
  __device__ T* k_at(int stage) const { return kv + 2 * stage * kTileElems; }
  __device__ T* v_at(int stage) const { return kv + (2 * stage + 1) * kTileElems; }
  __device__ int64_t tile_at(const BlockLut& L, int i) const {
    return row_tile<D>(L, e0, g.sub, base, i);
  }
  __device__ void fetch(const T* k, const T* v, int64_t off, int stage) const {
    cp_tile<T, D>(k_at(stage), k + off);
    cp_tile<T, D>(v_at(stage), v + off);
  }
  // Which of tile i's four 16-key steps the warp's 16 rows attend to (bit np).
  __device__ uint32_t steps(const BlockLut& L, const FlashExtras& x, int i, int warp) const {
    return x.tile_mask ? (x.tile_mask[L.row_idx[e0 + i / g.sub]] >> (4 * warp)) & 0xFu : 0xFu;
  }
  // The bias of tile i's keys, or null.
  __device__ const float* bias(const BlockLut& L, const FlashExtras& x, int i) const {
    return x.key_bias ? x.key_bias + g.bh / L.heads * g.seq + row_tile<1>(L, e0, g.sub, 0, i)
                      : nullptr;
  }
};

// Four 8x8 matrices (see the layouts above); `p` is this lane's row address.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// The same, each matrix transposed on the way (rows as stored become columns).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a b for one m16n8k16 tile: a 16x16 A and a 16x8 B of T, fp32 C/D (layouts above).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(std::is_same_v<T, __half>, "16-bit dtypes only");
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c0, c1 += a times the 16 columns of B that one ldmatrix x4 brings from this lane's address
// p: columns 0-7 into c0, 8-15 into c1. Trans when B is stored k-major (rows are k).
template <typename T, bool Trans>
__device__ __forceinline__ void mma_16cols(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                           const T* p) {
  uint32_t b[4];
  if constexpr (Trans) {
    ldmatrix_x4_trans(b, p);
  } else {
    ldmatrix_x4(b, p);
  }
  mma16816<T>(c0, a, b[0], b[1]);
  mma16816<T>(c1, a, b[2], b[3]);
}

// acc (16 x D) += a (16 x 16) times the 16 x D block of a k-major B whose rows start at this
// lane's address p (row 16kk + l % 16, column 8 (l / 16) of it).
template <typename T, int D>
__device__ __forceinline__ void mma_k16xd(float (&acc)[D / 8][4], const uint32_t (&a)[4],
                                          const T* p) {
#pragma unroll
  for (int dd = 0; dd < D / 16; ++dd) {
    mma_16cols<T, true>(acc[2 * dd], acc[2 * dd + 1], a, p + dd * 16);
  }
}

// Two floats rounded to T in one b32, `lo` in the low half (the lower column of a fragment).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &p, sizeof(r));
  } else {
    const __half2 p = __floats2half2_rn(lo, hi);
    memcpy(&r, &p, sizeof(r));
  }
  return r;
}

// Max and sum over the 4 lanes of a quad (lane / 4 equal): they hold one fragment row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The warp's 16 rows of an fp32 result held as C fragments (acc[j]: columns 8j.., rows gr and
// gr + 8h, times mul[h]), to global rows out[0..15] of D, through the same rows (`os`, row 0 of
// the warp's) of a shared tile, so that global stores are 16 bytes.
template <typename T, int D>
__device__ __forceinline__ void write_rows(T* out, const float (&acc)[D / 8][4],
                                           const float (&mul)[2], T* os) {
  constexpr int kLd = Ld<T, D>::kTile, kVec = 16 / sizeof(T), kPerRow = D / kVec;
  const int lane = threadIdx.x % 32, gr = lane / 4, gc = lane % 4;
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint32_t*>(os + (gr + 8 * h) * kLd + 8 * j + 2 * gc) =
          pack2<T>(acc[j][2 * h] * mul[h], acc[j][2 * h + 1] * mul[h]);
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < 16 * kPerRow / 32; ++i) {
    const int e = lane + 32 * i, r = e / kPerRow, c = (e % kPerRow) * kVec;
    *reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * D + c) =
        *reinterpret_cast<const uint4*>(os + r * kLd + c);
  }
}

// The forward, FlashAttention-2 style: each warp keeps its 16 query rows of Q (A fragments),
// of the scores S and of the output O (fp32 C fragments) in registers, and only K and V go
// through shared memory, in two stages fetched with cp.async: tile i + 1 streams in while tile
// i is computed. A lane holds rows gr and gr + 8 of the warp's 16, columns 2gc, 2gc + 1 of each
// 8-column slice, so a row's max and sum take two shuffles within its quad. At D = 64 it fits
// 128 registers without spilling, which lets 4 blocks share an SM instead of 3.
template <typename T, int D, bool kExtra>
__global__ void __launch_bounds__(kThreads, D == 64 ? 4 : 1)
    flash_fwd_kernel(BlockLut L, const T* q, const T* k, const T* v, T* o, float* lse, float scale,
                     FlashExtras x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync and cp.async need sm_80; the binding refuses older devices
#else
  constexpr int kLd = Ld<T, D>::kTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const RowWalk<T, D> w(L, smem);  // Q borrows stage 1's K until it is in registers
  const Tiling& g = w.g;
  const int64_t t = w.t, base = w.base;
  const int n = w.n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int gr = lane / 4, gc = lane % 4;
  const float sl2 = scale * kLog2e;
  auto k_at = [&](int stage) { return w.k_at(stage); };
  auto v_at = [&](int stage) { return w.v_at(stage); };
  auto tile_at = [&](int i) { return w.tile_at(L, i); };
  auto fetch = [&](int64_t off, int stage) { w.fetch(k, v, off, stage); };

  cp_tile<T, D>(k_at(1), q + base + t * kT * D);
  if (n > 0) fetch(tile_at(0), 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  // The warp's Q rows as A fragments, one per 16 columns of D. Lane l points at row l % 16 and
  // column 8 (l / 16) of the 16x16 block, so the four matrices are its quarters in a[0..3]
  // order: rows 0-7 / 8-15 of columns 0-7, then of columns 8-15.
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    ldmatrix_x4(qf[kk], k_at(1) + (r0 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8);
  }

  float acc[D / 8][4] = {};               // O, columns 8j.. of rows gr, gr + 8
  float m[2] = {-INFINITY, -INFINITY};    // running max of rows gr, gr + 8 (log2 units)
  float l[2] = {0.f, 0.f};                // this lane's share of their running sums
  int64_t next = n > 1 ? tile_at(1) : 0;  // looked up a tile ahead: its loads overlap the math
  for (int i = 0; i < n; ++i) {
    const int st = advance_stage(i, n, next, fetch, tile_at);  // stage 1 held Q at i = 0
    const T* ks = k_at(st);
    const T* vs = v_at(st);
    uint32_t bits = 0xFu;       // which of its four 16-key steps the warp's rows attend to
    const float* kb = nullptr;  // the bias of the tile's keys
    if constexpr (kExtra) {
      bits = w.steps(L, x, i, warp);
      kb = w.bias(L, x, i);
      if (bits == 0) continue;
    }

    // S = Q K^T: K^T's "col" B fragment is K's rows as stored. Lane l points at key
    // 16np + l % 8 + 8 (l / 16), column 8 ((l / 8) % 2) of the 16-column step, so registers
    // 0, 1 are B for keys 16np..+7 and registers 2, 3 for keys 16np + 8..+15.
    float s[kT / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kT / 16; ++np) {
        if (kExtra && !((bits >> np) & 1u)) continue;
        mma_16cols<T, false>(
            s[2 * np], s[2 * np + 1], qf[kk],
            ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * kLd + kk * 16 + ((lane >> 3) & 1) * 8);
      }
    }

    // Online softmax on the fragments: s[j][h * 2 + x] is row gr + 8h, key 8j + 2gc + x.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < kT / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] *= sl2;
        if constexpr (kExtra) {
          if (!((bits >> (j / 2)) & 1u)) {
            s[j][e] = -INFINITY;
          } else if (kb) {
            s[j][e] += kb[8 * j + 2 * gc + (e & 1)] * kLog2e;
          }
        }
        mx[e / 2] = fmaxf(mx[e / 2], s[j][e]);
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = quad_max(mx[h]);
      alpha[h] = m[h] == -INFINITY ? 0.f : exp2f(m[h] - mx[h]);
      m[h] = mx[h];
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int j = 0; j < kT / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // a row that has seen only -inf so far takes 0 as its max (see the note)
        const float mu = kExtra && m[e / 2] == -INFINITY ? 0.f : m[e / 2];
        s[j][e] = exp2f(s[j][e] - mu);
        l[e / 2] += s[j][e];
      }
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] *= alpha[e / 2];
    }

    // O += P V. The C fragments of key slices 2kk and 2kk + 1 are, element for element, the A
    // fragment of keys 16kk..+15: a[0] = (gr, 2gc..) of slice 2kk, a[1] its row gr + 8, a[2],
    // a[3] the same of slice 2kk + 1 (keys 16kk + 8 + 2gc..). V's "col" B fragment needs two
    // consecutive keys of one column per register, hence .trans: lane l points at key
    // 16kk + l % 16, column 16dp + 8 (l / 16), so registers 0, 1 are B for columns 16dp..+7
    // and registers 2, 3 for columns 16dp + 8..+15.
#pragma unroll
    for (int kk = 0; kk < kT / 16; ++kk) {
      if (kExtra && !((bits >> kk) & 1u)) continue;  // P is 0 there
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      mma_k16xd<T, D>(acc, a, vs + (kk * 16 + (lane & 15)) * kLd + (lane >> 4) * 8);
    }
  }

  // O / l, through the warp's own rows of stage 0's K
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with both stages
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = quad_sum(l[h]);
    inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;  // a row with no keys gives zeros
  }
  write_rows<T, D>(o + base + (t * kT + r0) * D, acc, inv, k_at(0) + r0 * kLd);
  if (gc == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lse[g.bh * g.seq + t * kT + r0 + gr + 8 * h] = l[h] > 0.f ? m[h] + log2f(l[h]) : INFINITY;
    }
  }
#endif
}

// dvec[row] = sum over d of dout * o: the softmax backward's per-query dot product.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_dot_kernel(const T* o, const T* dout, float* dvec, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int d = lane; d < D; d += 32) s += to_float(o[row * D + d]) * to_float(dout[row * D + d]);
  s = warp_sum(s);
  if (lane == 0) dvec[row] = s;
}

// dK and dV of one key tile, the mirror of the forward: each warp keeps its 16 keys of K and V
// (A fragments) and of dK and dV (fp32 C fragments) in registers, and walks the key tile's
// layout column. Q, dO and the query tile's lse and dvec come through shared memory in two
// cp.async stages. Working 16 queries at a time keeps S^T, dP^T, P^T and dS^T to a few
// registers: P^T and dS^T are A fragments as soon as they are computed.
template <typename T, int D, bool kExtra>
__global__ void __launch_bounds__(kThreads, D == 64 ? 3 : 1)
    flash_bwd_kv_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                        const float* lse, const float* dvec, T* dk, T* dv, float scale,
                        FlashExtras x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int kLd = Ld<T, D>::kTile, kTileElems = kT * kLd;
  constexpr bool kVRegs = Ld<T, D>::kBwdKVRegs;
  static_assert(kThreads == 2 * kT, "one thread per lse and dvec value of a tile");
  extern __shared__ __align__(128) unsigned char smem[];
  // Stage s holds Q at q_at(s), dO after it, and the tile's lse and dvec (kT floats each) at
  // rows_at(s). K (and V) borrow stage 1 until they are in registers; without kVRegs, V stays
  // at vs for the whole kernel.
  T* const qd = reinterpret_cast<T*>(smem);
  float* const rows = reinterpret_cast<float*>(qd + 4 * kTileElems);
  T* const vs = reinterpret_cast<T*>(rows + 4 * kT);
  auto q_at = [qd](int stage) { return qd + 2 * stage * kTileElems; };
  auto do_at = [qd](int stage) { return qd + (2 * stage + 1) * kTileElems; };
  auto rows_at = [rows](int stage) { return rows + 2 * stage * kT; };
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int gc = lane % 4;
  const float sl2 = scale * kLog2e;
  const int32_t e0 = L.col_ptr[key];
  const int n = (L.col_ptr[key + 1] - e0) * g.sub;  // query tiles of the layout column
  // Query tile i of the column is tile i % sub of its (i / sub)-th layout block, in col_ptr order.
  auto tile_at = [&](int i) {
    const int64_t r = L.blocks[3 * static_cast<int64_t>(L.col_idx[e0 + i / g.sub]) + 1];
    return r * g.sub + i % g.sub;
  };
  // lse and dvec need only 4-byte alignment, hence one float per thread.
  const int half = threadIdx.x / kT, at = threadIdx.x % kT;
  auto fetch = [&](int64_t qt, int stage) {
    cp_tile<T, D>(q_at(stage), q + base + qt * kT * D);
    cp_tile<T, D>(do_at(stage), dout + base + qt * kT * D);
    cp_async4(rows_at(stage) + half * kT + at,
              (half == 0 ? lse : dvec) + g.bh * g.seq + qt * kT + at);
  };

  cp_tile<T, D>(q_at(1), k + base + t * kT * D);
  cp_tile<T, D>(kVRegs ? do_at(1) : vs, v + base + t * kT * D);
  if (n > 0) fetch(tile_at(0), 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  // The warp's K and V rows as A fragments, as the forward's Q.
  const int aoff = (r0 + (lane & 15)) * kLd + (lane >> 4) * 8;
  uint32_t kf[D / 16][4], vf[kVRegs ? D / 16 : 1][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    ldmatrix_x4(kf[kk], q_at(1) + aoff + kk * 16);
    if constexpr (kVRegs) ldmatrix_x4(vf[kk], do_at(1) + aoff + kk * 16);
  }

  float dka[D / 8][4] = {}, dva[D / 8][4] = {};  // columns 8j.. of keys r0 + gr, r0 + gr + 8
  float kbk[2] = {0.f, 0.f};                     // the bias of those two keys (log2 units)
  if constexpr (kExtra) {
    if (x.key_bias) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        kbk[h] = x.key_bias[g.bh / L.heads * g.seq + t * kT + r0 + lane / 4 + 8 * h] * kLog2e;
      }
    }
  }
  int64_t next = n > 1 ? tile_at(1) : 0;
  for (int i = 0; i < n; ++i) {
    const int st = advance_stage(i, n, next, fetch, tile_at);  // stage 1 held K and V at i = 0
    const T* qs = q_at(st);
    const T* dos = do_at(st);
    const float* ls = rows_at(st);
    const float* ds = ls + kT;
    uint32_t bits = 0xFFFFu;  // the tile's sub-blocks: bit 4 (query step) + (key step)
    if constexpr (kExtra) {
      if (x.tile_mask) bits = x.tile_mask[L.col_idx[e0 + i / g.sub]];
    }
#pragma unroll
    for (int np = 0; np < kT / 16; ++np) {                        // queries 16np..+15
      if (kExtra && !((bits >> (4 * np + warp)) & 1u)) continue;  // P^T is 0 there
      // S^T = K Q^T and dP^T = V dO^T: B fragments from Q and dO rows as stored (the
      // forward's K).
      float s[2][4] = {}, dp[2][4] = {};
      const int boff = (np * 16 + (lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        mma_16cols<T, false>(s[0], s[1], kf[kk], qs + boff + kk * 16);
        if constexpr (!kVRegs) ldmatrix_x4(vf[0], vs + aoff + kk * 16);
        mma_16cols<T, false>(dp[0], dp[1], vf[kVRegs ? kk : 0], dos + boff + kk * 16);
      }
      // s[j][2h + x] is key gr + 8h, query 16np + 8j + 2gc + x; P^T and dS^T go straight
      // into A fragments, as the forward's P.
      uint32_t pa[4], da[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int c = np * 16 + 8 * j + 2 * gc;
        const float2 l2 = *reinterpret_cast<const float2*>(ls + c);
        const float2 d2 = *reinterpret_cast<const float2*>(ds + c);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x0 = s[j][2 * h] * sl2 - l2.x, x1 = s[j][2 * h + 1] * sl2 - l2.y;
          if constexpr (kExtra) x0 += kbk[h], x1 += kbk[h];
          const float p0 = exp2f(x0), p1 = exp2f(x1);
          pa[2 * j + h] = pack2<T>(p0, p1);
          da[2 * j + h] = pack2<T>(p0 * (dp[j][2 * h] - d2.x), p1 * (dp[j][2 * h + 1] - d2.y));
        }
      }
      // dV += P^T dO and dK += dS^T Q: B fragments via .trans (the forward's V).
      const int toff = (np * 16 + (lane & 15)) * kLd + (lane >> 4) * 8;
      mma_k16xd<T, D>(dva, pa, dos + toff);
      mma_k16xd<T, D>(dka, da, qs + toff);
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // every warp is done with both stages
  const int64_t out = base + (t * kT + r0) * D;
  const float by_scale[2] = {scale, scale}, by_one[2] = {1.f, 1.f};
  write_rows<T, D>(dk + out, dka, by_scale, q_at(0) + r0 * kLd);
  write_rows<T, D>(dv + out, dva, by_one, do_at(0) + r0 * kLd);
#endif
}

// dQ of one query tile: each warp keeps its 16 queries of Q and dO (A fragments), their lse
// and dvec, and dQ (fp32 C fragments) in registers, and walks the query tile's layout row as
// the forward does, K and V in two cp.async stages. 16 keys at a time, as dK/dV.
template <typename T, int D, bool kExtra>
__global__ void __launch_bounds__(kThreads, D == 64 ? 4 : 2)
    flash_bwd_q_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                       const float* lse, const float* dvec, T* dq, float scale, FlashExtras x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  constexpr int kLd = Ld<T, D>::kTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const RowWalk<T, D> w(L, smem);  // Q and dO borrow stage 1 until they are in registers
  const Tiling& g = w.g;
  const int64_t t = w.t, base = w.base;
  const int n = w.n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int gr = lane / 4, gc = lane % 4;
  const float sl2 = scale * kLog2e;
  auto k_at = [&](int stage) { return w.k_at(stage); };
  auto v_at = [&](int stage) { return w.v_at(stage); };
  auto tile_at = [&](int i) { return w.tile_at(L, i); };
  auto fetch = [&](int64_t off, int stage) { w.fetch(k, v, off, stage); };

  cp_tile<T, D>(k_at(1), q + base + t * kT * D);
  cp_tile<T, D>(v_at(1), dout + base + t * kT * D);
  if (n > 0) fetch(tile_at(0), 0);
  cp_async_commit();
  float lr[2], dr[2];  // lse and dvec of rows gr, gr + 8
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = g.bh * g.seq + t * kT + r0 + gr + 8 * h;
    lr[h] = lse[row];
    dr[h] = dvec[row];
  }
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[D / 16][4], df[D / 16][4];  // the warp's Q and dO rows, as the forward's Q
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const int off = (r0 + (lane & 15)) * kLd + kk * 16 + (lane >> 4) * 8;
    ldmatrix_x4(qf[kk], k_at(1) + off);
    ldmatrix_x4(df[kk], v_at(1) + off);
  }

  float acc[D / 8][4] = {};  // dQ, columns 8j.. of rows gr, gr + 8
  int64_t next = n > 1 ? tile_at(1) : 0;
  for (int i = 0; i < n; ++i) {
    const int st = advance_stage(i, n, next, fetch, tile_at);  // stage 1 held Q and dO at i = 0
    const T* ks = k_at(st);
    const T* vs = v_at(st);
    uint32_t bits = 0xFu;       // as in the forward
    const float* kb = nullptr;  // the bias of the tile's keys
    if constexpr (kExtra) {
      bits = w.steps(L, x, i, warp);
      kb = w.bias(L, x, i);
    }
#pragma unroll
    for (int np = 0; np < kT / 16; ++np) {           // keys 16np..+15
      if (kExtra && !((bits >> np) & 1u)) continue;  // dS is 0 there
      float s[2][4] = {}, dp[2][4] = {};             // S = Q K^T, dP = dO V^T
      const int boff = (np * 16 + (lane & 7) + (lane >> 4) * 8) * kLd + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        mma_16cols<T, false>(s[0], s[1], qf[kk], ks + boff + kk * 16);
        mma_16cols<T, false>(dp[0], dp[1], df[kk], vs + boff + kk * 16);
      }
      // s[j][2h + x] is row gr + 8h, key 16np + 8j + 2gc + x.
      uint32_t a[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float2 b2 = {0.f, 0.f};  // keys 16np + 8j + 2gc, + 1
        if constexpr (kExtra) {
          if (kb) b2 = *reinterpret_cast<const float2*>(kb + 16 * np + 8 * j + 2 * gc);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x0 = s[j][2 * h] * sl2 - lr[h], x1 = s[j][2 * h + 1] * sl2 - lr[h];
          if constexpr (kExtra) x0 += b2.x * kLog2e, x1 += b2.y * kLog2e;
          const float p0 = exp2f(x0), p1 = exp2f(x1);
          a[2 * j + h] = pack2<T>(p0 * (dp[j][2 * h] - dr[h]), p1 * (dp[j][2 * h + 1] - dr[h]));
        }
      }
      // dQ += dS K: K's B fragment via .trans (the forward's V).
      mma_k16xd<T, D>(acc, a, ks + (np * 16 + (lane & 15)) * kLd + (lane >> 4) * 8);
    }
  }

  cp_async_wait<0>();
  __syncthreads();  // every warp is done with both stages
  const float by_scale[2] = {scale, scale};
  write_rows<T, D>(dq + base + (t * kT + r0) * D, acc, by_scale, k_at(0) + r0 * kLd);
#endif
}

// Calls f(T{}, std::integral_constant<int, D>{}, std::bool_constant<kExtra>{}) for a 16-bit
// dtype, head size 64 or 128, and whether there is a tile mask or key bias.
template <typename F>
void dispatch(DType t, int64_t head_dim, const FlashExtras& x, F&& f) {
  auto by_extra = [&](auto tag, auto dim) {
    if (x.tile_mask || x.key_bias) {
      f(tag, dim, std::true_type{});
    } else {
      f(tag, dim, std::false_type{});
    }
  };
  auto by_dim = [&](auto tag) {
    if (head_dim == 64) by_extra(tag, std::integral_constant<int, 64>{});
    if (head_dim == 128) by_extra(tag, std::integral_constant<int, 128>{});
  };
  if (t == DType::kFloat16) by_dim(__half{});
  if (t == DType::kBFloat16) by_dim(__nv_bfloat16{});
}

// Kernels over more than 48 KiB of shared memory must ask for it, once per kernel.
template <typename K>
cudaError_t allow_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

dim3 grid_of(const BlockLut& L, int64_t batch) {
  return dim3(static_cast<unsigned>(L.nb * L.block / kT), static_cast<unsigned>(batch * L.heads));
}

}  // namespace

bool bsr_flash_ok(int64_t block, int64_t head_dim) {
  return (block == 64 || block == 128) && (head_dim == 64 || head_dim == 128);
}

cudaError_t bsr_flash_fwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, void* o, float* lse, int64_t batch, int64_t head_dim,
                               float scale, const FlashExtras& extras, cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;  // stays so for a dtype or size with no kernel
  dispatch(t, head_dim, extras, [&](auto tag, auto dim, auto extra) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr bool E = decltype(extra)::value;
    constexpr size_t bytes = Ld<T, D>::kFwd;
    err = allow_smem(flash_fwd_kernel<T, D, E>, bytes);
    if (err != cudaSuccess) return;
    flash_fwd_kernel<T, D, E><<<grid_of(lut, batch), kThreads, bytes, stream>>>(
        lut, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(o), lse, scale, extras);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t bsr_flash_bwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, const void* o, const float* lse, const void* dout,
                               float* dvec, void* dq, void* dk, void* dv, int64_t batch,
                               int64_t head_dim, float scale, const FlashExtras& extras,
                               cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch(t, head_dim, extras, [&](auto tag, auto dim, auto extra) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr bool E = decltype(extra)::value;
    const auto* qt = static_cast<const T*>(q);
    const auto* kt = static_cast<const T*>(k);
    const auto* vt = static_cast<const T*>(v);
    const auto* dot = static_cast<const T*>(dout);
    const int64_t rows = batch * lut.heads * lut.nb * lut.block;
    flash_dot_kernel<T, D>
        <<<static_cast<unsigned>((rows + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
            static_cast<const T*>(o), dot, dvec, rows);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    err = allow_smem(flash_bwd_kv_kernel<T, D, E>, Ld<T, D>::kBwdKV);
    if (err != cudaSuccess) return;
    flash_bwd_kv_kernel<T, D, E><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdKV, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dk), static_cast<T*>(dv), scale, extras);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    err = allow_smem(flash_bwd_q_kernel<T, D, E>, Ld<T, D>::kBwdQ);
    if (err != cudaSuccess) return;
    flash_bwd_q_kernel<T, D, E><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdQ, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dq), scale, extras);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ds
