// Fused block-sparse attention on CUDA ([Note: fused block-sparse attention]).
//
// [Note: fused block-sparse attention]
// SparseSelfAttention without rpe or masks as three kernels that never write the scores (the
// unfused ops write the scores, the probabilities and their gradients, each batch * nnz *
// block^2): the forward; dK and dV by key tile; dQ by query tile, so nothing needs atomics.
// - Tiles are 64 queries by 64 keys. A layout block of 64 is one tile, one of 128 four. The
//   forward and dQ walk a query tile's layout row (row_ptr), dK/dV a key tile's column
//   (col_ptr).
// - A thread block is 4 warps, and each warp owns 16 rows of every tile it computes: queries in
//   the forward and dQ, keys in dK/dV. The products run on tensor cores with fp32 accumulators.
// - The forward keeps them in registers (mma.sync m16n8k16, FlashAttention-2 style): Q, the
//   scores, the probabilities and the output never touch shared memory, which only holds K and
//   V, fetched with cp.async into two stages so the next tile loads while this one computes.
// - The backward still runs WMMA 16x16x16 from shared memory: each warp rescales and
//   exponentiates its own rows of the scores there, so only the loads of shared operands need a
//   block barrier.
// - Scores are kept in log2 units (scale * log2(e) folded in). The forward keeps a running max
//   and sum per query (online softmax), rescales its fp32 output rows by exp2(old - new max),
//   and saves each query's log2-sum-exp; the backward recomputes P = exp2(S - lse) from it.
// - dS = P (dP - rowsum(dO * O)) is rounded to 16 bits before its products, as P is before PV
//   (as in FlashAttention).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_convert.cuh"
#include "sparse_flash_cuda.h"

namespace ds {
namespace {

using cvt::from_float;
using cvt::to_float;
namespace wm = nvcuda::wmma;

constexpr int kT = 64;  // tile side: queries and keys
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;

using Acc = wm::fragment<wm::accumulator, 16, 16, 16, float>;

// Shared memory: 16-bit rows padded by 16 bytes and fp32 rows by 16 bytes (against bank
// conflicts: the 8 rows an ldmatrix reads at once start 16 bytes apart modulo 128); every size
// is a multiple of 32 bytes, so each 16-row WMMA tile stays aligned.
template <typename T, int D>
struct Ld {
  static constexpr int kTile = D + 8;  // a 64 x D tile of T
  static constexpr int kS = kT + 4;    // a 64 x 64 fp32 tile
  static constexpr int kP = kT + 8;    // a 64 x 64 tile of T
  static constexpr size_t kTileBytes = sizeof(T) * kT * kTile;
  static constexpr size_t kSBytes = sizeof(float) * kT * kS;
  static constexpr size_t kPBytes = sizeof(T) * kT * kP;
  static constexpr size_t kRowBytes = sizeof(float) * kT;
  static constexpr size_t kFwd = 4 * kTileBytes;  // two stages of K and V (Q borrows one)
  static constexpr size_t kBwdKV = 4 * kTileBytes + 2 * kSBytes + 2 * kPBytes + 2 * kRowBytes;
  static constexpr size_t kBwdQ = 4 * kTileBytes + 2 * kSBytes + kPBytes + 2 * kRowBytes;
};

// A bump allocator over the dynamic shared memory.
struct Carve {
  unsigned char* p;
  template <typename U>
  __device__ U* take(size_t bytes) {
    U* r = reinterpret_cast<U*>(p);
    p += bytes;
    return r;
  }
};

// dst[64][D + 8] = the 64 contiguous rows of D elements at src, in 16-byte pieces.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* dst, const T* src) {
  constexpr int kVec = 16 / sizeof(T), kPerRow = D / kVec;
  for (int e = threadIdx.x; e < kT * kPerRow; e += kThreads) {
    const int r = e / kPerRow, c = (e % kPerRow) * kVec;
    *reinterpret_cast<uint4*>(dst + r * Ld<T, D>::kTile + c) =
        __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * D + c));
  }
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// acc[n] = a[16][K] @ b^T for 16-column slices n, where bt holds b's transpose: N rows of K.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_abt(Acc (&acc)[N / 16], const T* a, int lda, const T* bt,
                                        int ldb) {
#pragma unroll
  for (int n = 0; n < N / 16; ++n) wm::fill_fragment(acc[n], 0.f);
#pragma unroll
  for (int k = 0; k < K; k += 16) {
    wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
    wm::load_matrix_sync(fa, a + k, lda);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fb;
      wm::load_matrix_sync(fb, bt + n * 16 * ldb + k, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// acc[n] += a[16][K] @ b[K][N] (b row-major), for 16-column slices n.
template <typename T, int K, int N>
__device__ __forceinline__ void mma_ab(Acc (&acc)[N / 16], const T* a, int lda, const T* b,
                                       int ldb) {
#pragma unroll
  for (int k = 0; k < K; k += 16) {
    wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
    wm::load_matrix_sync(fa, a + k, lda);
#pragma unroll
    for (int n = 0; n < N / 16; ++n) {
      wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fb;
      wm::load_matrix_sync(fb, b + k * ldb + n * 16, ldb);
      wm::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

template <int N>
__device__ __forceinline__ void store_rows(float* dst, int ld, Acc (&acc)[N / 16]) {
#pragma unroll
  for (int n = 0; n < N / 16; ++n)
    wm::store_matrix_sync(dst + n * 16, acc[n], ld, wm::mem_row_major);
}

// The warp's 16 rows of a [64, D] fp32 result to global rows out[row * D + col] * mul, through a
// 16x16 staging tile of the warp's own (`stage`, 256 floats).
template <typename T, int D>
__device__ __forceinline__ void write_rows(T* out, Acc (&acc)[D / 16], float mul, float* stage) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wm::store_matrix_sync(stage, acc[n], 16, wm::mem_row_major);
    __syncwarp();
    for (int e = lane; e < 256; e += 32) {
      out[static_cast<int64_t>(e / 16) * D + n * 16 + e % 16] = from_float<T>(stage[e] * mul);
    }
    __syncwarp();
  }
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

// Register-level tensor-core pieces of the forward (sm_80+). The fragment layouts they rely on
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

// The forward, FlashAttention-2 style: each warp keeps its 16 query rows of Q (A fragments),
// of the scores S and of the output O (fp32 C fragments) in registers, and only K and V go
// through shared memory, in two stages fetched with cp.async: tile i + 1 streams in while tile
// i is computed. A lane holds rows gr and gr + 8 of the warp's 16, columns 2gc, 2gc + 1 of each
// 8-column slice, so a row's max and sum take two shuffles within its quad. At D = 64 it fits
// 128 registers without spilling, which lets 4 blocks share an SM instead of 3.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, D == 64 ? 4 : 1)
    flash_fwd_kernel(BlockLut L, const T* q, const T* k, const T* v, T* o, float* lse,
                     float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 mma.sync and cp.async need sm_80; the binding refuses older devices
#else
  constexpr int kLd = Ld<T, D>::kTile, kTileElems = kT * kLd;
  extern __shared__ __align__(128) unsigned char smem[];
  // Stage s holds K at k_at(s) and V after it. Q borrows stage 1's K until it is in registers.
  T* const kv = reinterpret_cast<T*>(smem);
  auto k_at = [kv](int stage) { return kv + 2 * stage * kTileElems; };
  auto v_at = [kv](int stage) { return kv + (2 * stage + 1) * kTileElems; };
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const int gr = lane / 4, gc = lane % 4;
  const float sl2 = scale * kLog2e;
  const int32_t e0 = L.row_ptr[key];
  const int n = (L.row_ptr[key + 1] - e0) * g.sub;  // key tiles of the layout row
  // Key tile i of the row is tile i % sub of its (i / sub)-th layout block, in row_ptr order;
  // tile_at gives its element offset in k and v.
  auto tile_at = [&](int i) {
    const int64_t c = L.blocks[3 * static_cast<int64_t>(L.row_idx[e0 + i / g.sub]) + 2];
    return base + (c * g.sub + i % g.sub) * kT * D;
  };
  auto fetch = [&](int64_t off, int stage) {
    cp_tile<T, D>(k_at(stage), k + off);
    cp_tile<T, D>(v_at(stage), v + off);
  };

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
    const int st = i & 1;
    __syncthreads();  // every warp is done with stage st ^ 1 (tile i - 1, or Q)
    if (i + 1 < n) fetch(next, st ^ 1);
    cp_async_commit();  // empty on the last tile, which keeps the count below right
    if (i + 2 < n) next = tile_at(i + 2);
    cp_async_wait<1>();  // this thread's part of tile i has landed...
    __syncthreads();     // ...and every thread's
    const T* ks = k_at(st);
    const T* vs = v_at(st);

    // S = Q K^T: K^T's "col" B fragment is K's rows as stored. Lane l points at key
    // 16np + l % 8 + 8 (l / 16), column 8 ((l / 8) % 2) of the 16-column step, so registers
    // 0, 1 are B for keys 16np..+7 and registers 2, 3 for keys 16np + 8..+15.
    float s[kT / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kT / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, ks + (np * 16 + (lane & 7) + (lane >> 4) * 8) * kLd + kk * 16 +
                           ((lane >> 3) & 1) * 8);
        mma16816<T>(s[2 * np], qf[kk], b[0], b[1]);
        mma16816<T>(s[2 * np + 1], qf[kk], b[2], b[3]);
      }
    }

    // Online softmax on the fragments: s[j][h * 2 + x] is row gr + 8h, key 8j + 2gc + x.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < kT / 8; ++j) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        s[j][x] *= sl2;
        mx[x / 2] = fmaxf(mx[x / 2], s[j][x]);
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
      for (int x = 0; x < 4; ++x) {
        s[j][x] = exp2f(s[j][x] - m[x / 2]);
        l[x / 2] += s[j][x];
      }
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
#pragma unroll
      for (int x = 0; x < 4; ++x) acc[j][x] *= alpha[x / 2];
    }

    // O += P V. The C fragments of key slices 2kk and 2kk + 1 are, element for element, the A
    // fragment of keys 16kk..+15: a[0] = (gr, 2gc..) of slice 2kk, a[1] its row gr + 8, a[2],
    // a[3] the same of slice 2kk + 1 (keys 16kk + 8 + 2gc..). V's "col" B fragment needs two
    // consecutive keys of one column per register, hence .trans: lane l points at key
    // 16kk + l % 16, column 16dp + 8 (l / 16), so registers 0, 1 are B for columns 16dp..+7
    // and registers 2, 3 for columns 16dp + 8..+15.
#pragma unroll
    for (int kk = 0; kk < kT / 16; ++kk) {
      const uint32_t a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, vs + (kk * 16 + (lane & 15)) * kLd + dp * 16 + (lane >> 4) * 8);
        mma16816<T>(acc[2 * dp], a, b[0], b[1]);
        mma16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // O / l through the warp's own rows of stage 0's K, so that global stores are 16 bytes.
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with both stages
  T* const os = k_at(0);
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] = quad_sum(l[h]);
    inv[h] = l[h] > 0.f ? 1.f / l[h] : 0.f;  // a row with no keys gives zeros
  }
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint32_t*>(os + (r0 + gr + 8 * h) * kLd + 8 * j + 2 * gc) =
          pack2<T>(acc[j][2 * h] * inv[h], acc[j][2 * h + 1] * inv[h]);
    }
  }
  __syncwarp();
  constexpr int kVec = 16 / sizeof(T), kPerRow = D / kVec;
#pragma unroll
  for (int i = 0; i < 16 * kPerRow / 32; ++i) {
    const int e = lane + 32 * i, r = r0 + e / kPerRow, c = (e % kPerRow) * kVec;
    *reinterpret_cast<uint4*>(o + base + (t * kT + r) * D + c) =
        *reinterpret_cast<const uint4*>(os + r * kLd + c);
  }
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

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_kv_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                        const float* lse, const float* dvec, T* dk, T* dv, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using S = Ld<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve cv{smem};
  T* ks = cv.take<T>(S::kTileBytes);
  T* vs = cv.take<T>(S::kTileBytes);
  T* qs = cv.take<T>(S::kTileBytes);
  T* dos = cv.take<T>(S::kTileBytes);
  float* st = cv.take<float>(S::kSBytes);   // S^T: keys x queries
  float* dpt = cv.take<float>(S::kSBytes);  // dP^T
  T* pt = cv.take<T>(S::kPBytes);
  T* dst = cv.take<T>(S::kPBytes);
  float* lq = cv.take<float>(S::kRowBytes);
  float* dq_dot = cv.take<float>(S::kRowBytes);
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const float sl2 = scale * kLog2e;
  load_tile<T, D>(ks, k + base + t * kT * D);
  load_tile<T, D>(vs, v + base + t * kT * D);
  Acc dkf[D / 16], dvf[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wm::fill_fragment(dkf[n], 0.f);
    wm::fill_fragment(dvf[n], 0.f);
  }
  for (int32_t e = L.col_ptr[key]; e < L.col_ptr[key + 1]; ++e) {
    const int64_t r = L.blocks[3 * static_cast<int64_t>(L.col_idx[e]) + 1];
    for (int i = 0; i < g.sub; ++i) {
      const int64_t qt = r * g.sub + i, row0 = g.bh * g.seq + qt * kT;
      __syncthreads();  // every warp is done with the previous Q, dO and row terms
      load_tile<T, D>(qs, q + base + qt * kT * D);
      load_tile<T, D>(dos, dout + base + qt * kT * D);
      if (threadIdx.x < kT) {
        lq[threadIdx.x] = lse[row0 + threadIdx.x];
        dq_dot[threadIdx.x] = dvec[row0 + threadIdx.x];
      }
      __syncthreads();
      Acc a[kT / 16];
      mma_abt<T, D, kT>(a, ks + r0 * S::kTile, S::kTile, qs, S::kTile);  // S^T = K Q^T
      store_rows<kT>(st + r0 * S::kS, S::kS, a);
      mma_abt<T, D, kT>(a, vs + r0 * S::kTile, S::kTile, dos, S::kTile);  // dP^T = V dO^T
      store_rows<kT>(dpt + r0 * S::kS, S::kS, a);
      __syncwarp();
      for (int ii = 0; ii < 16; ++ii) {
        const int rr = r0 + ii;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = lane + 32 * half;  // the query
          const float p = exp2f(st[rr * S::kS + col] * sl2 - lq[col]);
          pt[rr * S::kP + col] = from_float<T>(p);
          dst[rr * S::kP + col] = from_float<T>(p * (dpt[rr * S::kS + col] - dq_dot[col]));
        }
      }
      __syncwarp();
      mma_ab<T, kT, D>(dvf, pt + r0 * S::kP, S::kP, dos, S::kTile);  // dV += P^T dO
      mma_ab<T, kT, D>(dkf, dst + r0 * S::kP, S::kP, qs, S::kTile);  // dK += dS^T Q
    }
  }
  const int64_t out0 = base + (t * kT + r0) * D;
  write_rows<T, D>(dk + out0, dkf, scale, st + r0 * S::kS);
  write_rows<T, D>(dv + out0, dvf, 1.f, st + r0 * S::kS);
#endif
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_bwd_q_kernel(BlockLut L, const T* q, const T* k, const T* v, const T* dout,
                       const float* lse, const float* dvec, T* dq, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using S = Ld<T, D>;
  extern __shared__ __align__(128) unsigned char smem[];
  Carve cv{smem};
  T* qs = cv.take<T>(S::kTileBytes);
  T* dos = cv.take<T>(S::kTileBytes);
  T* ks = cv.take<T>(S::kTileBytes);
  T* vs = cv.take<T>(S::kTileBytes);
  float* ss = cv.take<float>(S::kSBytes);
  float* dps = cv.take<float>(S::kSBytes);
  T* dss = cv.take<T>(S::kPBytes);
  float* lq = cv.take<float>(S::kRowBytes);
  float* dq_dot = cv.take<float>(S::kRowBytes);
  const Tiling g(L);
  const int64_t t = blockIdx.x, key = g.h * L.nb + t / g.sub, base = g.bh * g.seq * D;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r0 = warp * 16;
  const float sl2 = scale * kLog2e;
  load_tile<T, D>(qs, q + base + t * kT * D);
  load_tile<T, D>(dos, dout + base + t * kT * D);
  if (threadIdx.x < kT) {
    lq[threadIdx.x] = lse[g.bh * g.seq + t * kT + threadIdx.x];
    dq_dot[threadIdx.x] = dvec[g.bh * g.seq + t * kT + threadIdx.x];
  }
  Acc dqf[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wm::fill_fragment(dqf[n], 0.f);
  for (int32_t e = L.row_ptr[key]; e < L.row_ptr[key + 1]; ++e) {
    const int64_t c = L.blocks[3 * static_cast<int64_t>(L.row_idx[e]) + 2];
    for (int j = 0; j < g.sub; ++j) {
      const int64_t kt = c * g.sub + j;
      __syncthreads();  // every warp is done with the previous K and V (and Q, dO are in)
      load_tile<T, D>(ks, k + base + kt * kT * D);
      load_tile<T, D>(vs, v + base + kt * kT * D);
      __syncthreads();
      Acc a[kT / 16];
      mma_abt<T, D, kT>(a, qs + r0 * S::kTile, S::kTile, ks, S::kTile);  // S = Q K^T
      store_rows<kT>(ss + r0 * S::kS, S::kS, a);
      mma_abt<T, D, kT>(a, dos + r0 * S::kTile, S::kTile, vs, S::kTile);  // dP = dO V^T
      store_rows<kT>(dps + r0 * S::kS, S::kS, a);
      __syncwarp();
      for (int ii = 0; ii < 16; ++ii) {
        const int rr = r0 + ii;
        const float lrow = lq[rr], drow = dq_dot[rr];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int col = lane + 32 * half;  // the key
          const float p = exp2f(ss[rr * S::kS + col] * sl2 - lrow);
          dss[rr * S::kP + col] = from_float<T>(p * (dps[rr * S::kS + col] - drow));
        }
      }
      __syncwarp();
      mma_ab<T, kT, D>(dqf, dss + r0 * S::kP, S::kP, ks, S::kTile);  // dQ += dS K
    }
  }
  write_rows<T, D>(dq + base + (t * kT + r0) * D, dqf, scale, ss + r0 * S::kS);
#endif
}

// Calls f(T{}, std::integral_constant<int, D>{}) for a 16-bit dtype and head size 64 or 128.
template <typename F>
void dispatch(DType t, int64_t head_dim, F&& f) {
  auto by_dim = [&](auto tag) {
    if (head_dim == 64) f(tag, std::integral_constant<int, 64>{});
    if (head_dim == 128) f(tag, std::integral_constant<int, 128>{});
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
                               float scale, cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;  // stays so for a dtype or size with no kernel
  dispatch(t, head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    constexpr size_t bytes = Ld<T, D>::kFwd;
    err = allow_smem(flash_fwd_kernel<T, D>, bytes);
    if (err != cudaSuccess) return;
    flash_fwd_kernel<T, D><<<grid_of(lut, batch), kThreads, bytes, stream>>>(
        lut, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
        static_cast<T*>(o), lse, scale);
    err = cudaGetLastError();
  });
  return err;
}

cudaError_t bsr_flash_bwd_cuda(DType t, const BlockLut& lut, const void* q, const void* k,
                               const void* v, const void* o, const float* lse, const void* dout,
                               float* dvec, void* dq, void* dk, void* dv, int64_t batch,
                               int64_t head_dim, float scale, cudaStream_t stream) {
  if (batch * lut.nb == 0) return cudaSuccess;
  cudaError_t err = cudaErrorInvalidValue;
  dispatch(t, head_dim, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
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
    err = allow_smem(flash_bwd_kv_kernel<T, D>, Ld<T, D>::kBwdKV);
    if (err != cudaSuccess) return;
    flash_bwd_kv_kernel<T, D><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdKV, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dk), static_cast<T*>(dv), scale);
    err = cudaGetLastError();
    if (err != cudaSuccess) return;
    err = allow_smem(flash_bwd_q_kernel<T, D>, Ld<T, D>::kBwdQ);
    if (err != cudaSuccess) return;
    flash_bwd_q_kernel<T, D><<<grid_of(lut, batch), kThreads, Ld<T, D>::kBwdQ, stream>>>(
        lut, qt, kt, vt, dot, lse, dvec, static_cast<T*>(dq), scale);
    err = cudaGetLastError();
  });
  return err;
}

}  // namespace ds
