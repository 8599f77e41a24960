// Host-only checks of the d256 Hopper backward's index mappings (csrc/sm90/bwd_mma_wide.h), on fa2's own traits:
// the transposed shared-memory views, the head-dim halves, dQ's staging per half as the writer's TMA reads it, the
// dK/dV epilogue's lane swap and the stmatrix of P and dS (emulated from the copy atom's thread/value layouts).
// Nothing here runs a kernel.
//   CUT=$(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source/include')")
//   nvcc -std=c++17 -I$CUT -Icsrc --expt-relaxed-constexpr -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -arch=sm_90a \
//     -o /tmp/bwd_wide_maps bench/bwd_wide_maps.cu
//   /tmp/bwd_wide_maps   # 0 mismatches in each of the five
// (On the host CuTe prints "cast_smem_ptr_to_uint not supported" for the swizzled dQ staging; addresses still compare.)
#include <algorithm>
#include <cstdio>
#include <vector>

#include "host_check_cute.h"
#include "sm90/bwd_dq_stage.h"
#include "sm90/bwd_traits.h"

using namespace cute;
constexpr auto kTile = fa2::sm90::bwd_tile(256, false);
using T = fa2::sm90::BwdTraits<256, kTile.block_m, kTile.block_n, kTile.stages, fa2::DType::bf16>;
constexpr int kN = T::kBlockN;
using M = T::M;
using N = T::N;
using D = T::D;


// bwd_mma_wide.h's half_slice and utils.h's rowcol, host side (theirs are __device__).
template <int kH, class X>
auto half_slice(X&& t) {
  return logical_divide(t, Shape<Underscore, _2>{})(_, make_coord(Int<kH>{}, _), _);
}
template <class L>
auto rowcol(L const& l) {
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

int main() {
  printf("sizeof(SharedStorage) %d (config.h budget %d); k %zu v %zu q %zu dO %zu dS+P %zu dq %zu lse %zu d %zu\n",
         T::kSmemSize, fa2::sm90::bwd_smem_bytes(kTile), sizeof(T::SharedStorage::k), sizeof(T::SharedStorage::v),
         sizeof(T::SharedStorage::q), sizeof(T::SharedStorage::dO), sizeof(T::SharedStorage::dS),
         sizeof(T::SharedStorage::dq), sizeof(T::SharedStorage::lse), sizeof(T::SharedStorage::d));
  T::TiledMmaSdP mma_sdp;
  T::TiledMmadKV mma_dkv;
  T::TiledMmadQ mma_dq;

  // 1. Transposed views alias the bytes of the stored tiles.
  {
    T::SmemLayoutdS ds;
    T::SmemLayoutdSt dst;
    T::SmemLayoutK k;
    T::SmemLayoutKt kt;
    T::SmemLayoutQ q;
    T::SmemLayoutQt qt;
    T::SmemLayoutdO o;
    T::SmemLayoutdOt ot;
    for (int s = 0; s < 2; ++s)  // dS, P
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < kN; ++c) CHECK(dst(c, r, s) == ds(r, c, s), "dS^T (%d, %d, %d)\n", c, r, s);
    for (int r = 0; r < kN; ++r)
      for (int c = 0; c < 256; ++c) CHECK(kt(c, r) == k(r, c), "K^T (%d, %d)\n", c, r);
    for (int s = 0; s < 2; ++s)
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < 256; ++c) CHECK(qt(c, r, s) == q(r, c, s), "Q^T (%d, %d, %d)\n", c, r, s);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 256; ++c) CHECK(ot(c, r, 0) == o(r, c, 0), "dO^T (%d, %d)\n", c, r);
    printf("1. transposed views: %d mismatches\n", bad);
  }

  // 2. Halves: dK^T/dV^T half h holds dims [128h, 128h + 128) and K^T's half h feeds dQ's columns 128h + [0, 128).
  {
    const int before = bad;
    for (int tid = 0; tid < 256; ++tid) {
      Tensor c = mma_dkv.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<D, N>{}));
      auto h0 = half_slice<0>(c);
      auto h1 = half_slice<1>(c);
      CHECK(size(h0) == kN / 2 && size(h1) == kN / 2, "dKV half sizes\n");  // of kN fp32 a thread
      for (int i = 0; i < size(h0); ++i) {
        CHECK(get<0>(h0(i)) < 128 && get<0>(h1(i)) == get<0>(h0(i)) + 128, "dKV half tid %d i %d\n", tid, i);
        CHECK(get<0>(h0(i)) / 64 % 2 == tid / 128, "dKV warpgroup tid %d dim %d\n", tid, int(get<0>(h0(i))));
      }
      Tensor b = mma_dq.get_thread_slice(tid).partition_B(make_identity_tensor(Shape<D, N>{}));  // (d, keys)
      auto b0 = half_slice<0>(b);
      auto b1 = half_slice<1>(b);
      for (int i = 0; i < size(b0); ++i) {
        CHECK(get<0>(b0(i)) < 128 && get<0>(b1(i)) == get<0>(b0(i)) + 128, "dQ B half tid %d i %d: %d %d\n", tid, i,
              int(get<0>(b0(i))), int(get<0>(b1(i))));
      }
      // The A operand of dV^T's half h: dO^T's dims of the same half.
      Tensor a = mma_dkv.get_thread_slice(tid).partition_A(make_identity_tensor(Shape<D, M>{}));
      auto a1 = half_slice<1>(a);
      for (int i = 0; i < size(a1); ++i) {
        CHECK(get<0>(a1(i)) >= 128, "dKV A half tid %d i %d dim %d\n", tid, i, int(get<0>(a1(i))));
      }
    }
    printf("2. halves: %d mismatches\n", bad - before);
  }

  // 3. dQ's staging of a half (bwd_dq_stage.h: stage_dq, run on the host): each thread's accumulator holds the code of
  // its (query, column of the half); the writer's TMA reads slab w (SmemLayoutdQSlab, w slabs' size into the buffer)
  // as columns [64w, 64w + 64) of every query, each once.
  {
    const int before = bad;
    constexpr int kCols = T::kdQCols;
    alignas(1024) static float buf[64 * kCols];
    std::fill(buf, buf + 64 * kCols, -1.f);
    for (int tid = 0; tid < 256; ++tid) {
      Tensor c = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<M, Int<kCols>>{}));
      Tensor frag = partition_fragment_C(mma_dq, Shape<M, Int<kCols>>{});
      for (int i = 0; i < size(frag); ++i) frag(i) = float(get<0>(c(i)) * kCols + get<1>(c(i)));
      fa2::sm90::stage_dq<T>(mma_dq, tid, frag, buf);
    }
    T::SmemLayoutdQSlab slab;
    for (int w = 0; w < 2; ++w)
      for (int r = 0; r < 64; ++r)
        for (int c = 0; c < kCols / 2; ++c) {
          const int at = w * int(cosize(slab)) + int(slab.layout_a()(int(sizeof(float)) * slab.layout_b()(r, c))) / 4;
          CHECK(buf[at] == float(r * kCols + w * kCols / 2 + c), "dQ slab %d (%d, %d) holds %g\n", w, r, c, buf[at]);
        }
    printf("3. dQ staging: %d mismatches\n", bad - before);
  }

  // 4. Epilogue: after the swap with lane ^ 4 (the lower lane sends its (r, c + 1), the upper its (r, c)) a lane
  // stores (its key + upper; dims col, col + 1): upper ? (partner's (r, c + 1), own (r, c + 1)) : (own (r, c),
  // partner's (r, c)); every (dim, key) once.
  {
    const int before = bad;
    std::vector<int> hit(256 * kN, 0);
    for (int tid = 0; tid < 256; ++tid) {
      auto rc = [&](int t) {
        Tensor c = mma_dkv.get_thread_slice(t).partition_C(make_identity_tensor(Shape<D, N>{}));
        return make_tensor(c.data(), rowcol(c.layout()));
      };
      auto own = rc(tid);
      auto partner = rc(tid ^ 4);
      const int upper = (tid >> 2) & 1;
      for (int c = 0; c < size<1>(own); c += 2) {
        const int key = get<1>(own(0, c)) + upper;
        for (int r = 0; r < size<0>(own); ++r) {
          const int col = get<0>(own(r, c)) - upper;
          auto e0 = upper ? partner(r, c + 1) : own(r, c);
          auto e1 = upper ? own(r, c + 1) : partner(r, c);
          CHECK(get<0>(e0) == col && get<1>(e0) == key && get<0>(e1) == col + 1 && get<1>(e1) == key,
                "epilogue tid %d r %d c %d\n", tid, r, c);
          CHECK(col % 2 == 0, "epilogue pair not 4-byte aligned\n");
          hit[get<0>(e0) * kN + get<1>(e0)]++;
          hit[get<0>(e1) * kN + get<1>(e1)]++;
        }
      }
    }
    for (int x : hit) CHECK(x == 1, "dK/dV cell written %d times\n", x);
    printf("4. dK/dV epilogue: %d mismatches\n", bad - before);
  }
  // 5. stmatrix of P / dS, emulated (host_check_cute.h): each register on the (query, key) of its S accumulator
  // element, every cell of the 64 x kN tile once.
  {
    const int before = bad;
    check_stmatrix<T::SmemCopyAtomdS, Shape<M, N>>(mma_sdp, 64, kN, "P/dS");
    printf("5. P/dS stmatrix: %d mismatches\n", bad - before);
  }
  printf("%s: %d mismatches\n", bad ? "FAILED" : "ok", bad);
  return bad != 0;
}
