// Host-only checks of the d128 Hopper backward's 80 x 128 tile (csrc/sm90/bwd_traits.h: kdQSwapAB), on fa2's own
// traits: its shared storage, the transposed views of 80-row tiles, P^T as dV's register A operand at 80 queries, the
// stmatrix of dS^T (emulated from the copy atom's thread/value layouts), and dQ^T's staging (bwd_dq_stage.h): every
// register of the swapped dQ^T accumulator lands on its (query, column) of the row-major slab the writer's TMA reads,
// every cell once, and the shared-store wavefronts per instruction (the 64 x 128 tile's 64-bit stores alongside).
// Nothing runs a kernel.
//   CUT=$(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source/include')")
//   nvcc -std=c++17 -I$CUT -Icsrc --expt-relaxed-constexpr -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -arch=sm_90a \
//     -o /tmp/dq_swap_maps bench/dq_swap_maps.cu
//   /tmp/dq_swap_maps   # 0 mismatches in each part; 80 x 128: 1.00 wavefront per 32-bit store
// (On the host CuTe prints "cast_smem_ptr_to_uint not supported" for the swizzled tensors; addresses still compare.)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "sm90/bwd_dq_stage.h"
#include "host_check_cute.h"
#include "sm90/bwd_traits.h"

using namespace cute;


// bwd_kernel.h's rowcol_t and utils.h's as_operand_a, host side (theirs are __device__).
template <class L>
auto rowcol_t(L const& l) {
  return make_layout(make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)), make_layout(get<0, 1>(l), get<1>(l)));
}
template <class L>
auto as_operand_a(L const& l) {
  auto halves = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(halves)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(halves), get<2>(l))));
}

// The shared-memory wavefronts of one warp-wide store: the most distinct 4-byte words one bank must deliver, per
// group of lanes served together (32-bit stores: the warp; 64-bit: each half-warp, as ncu counts them).
int wavefronts(std::vector<int> const& bytes, int width) {
  const int group = width == 8 ? 16 : 32;
  int total = 0;
  for (int first = 0; first < 32; first += group) {
    std::map<int, std::set<int>> bank;
    for (int l = first; l < first + group; ++l)
      for (int w = 0; w < width / 4; ++w) bank[(bytes[l] / 4 + w) % 32].insert(bytes[l] / 4 + w);
    int most = 0;
    for (auto& [b, words] : bank) most = std::max<int>(most, words.size());
    total += most;
  }
  return total;
}

// dQ's staging (bwd_dq_stage.h: stage_dq) run on the host, twice. First each MMA thread's accumulator holds the code
// of its own (query, column), and the buffer is read back through the slab layout the writer's TMA uses; then it holds
// the code of (thread, register), which gives each store instruction's addresses (register i of every lane of a warp:
// one 32-bit store, or registers 2k and 2k + 1: one 64-bit store). Returns the mean wavefronts per store instruction.
template <class T>
double check_dq_staging(const char* name) {
  constexpr int kM = T::kBlockM, kD = T::kHeadDim;
  constexpr bool kSwap = T::kdQSwapAB;
  constexpr int kWidth = kSwap ? 4 : 8;  // bytes a store instruction writes per lane
  const int before = bad;
  typename T::TiledMmadQ mma;
  alignas(1024) static float buf[kM * kD];
  auto stage_all = [&](auto code) {
    std::fill(buf, buf + kM * kD, -1.f);
    for (int tid = 0; tid < 256; ++tid) {
      Tensor c = mma.get_thread_slice(tid).partition_C(make_identity_tensor(typename T::dQShape{}));  // GEMM's (M, N)
      Tensor frag = partition_fragment_C(mma, typename T::dQShape{});
      for (int i = 0; i < size(frag); ++i) {
        const int query = kSwap ? get<1>(c(i)) : get<0>(c(i)), col = kSwap ? get<0>(c(i)) : get<1>(c(i));
        frag(i) = code(tid, i, query, col);
      }
      fa2::sm90::stage_dq<T>(mma, tid, frag, buf);
    }
  };
  std::vector<int> owners(kM * kD, 0);
  stage_all([&](int tid, int, int query, int col) {
    CHECK(col / (kD / 2) == tid / 128, "%s: tid %d owns column %d, not its warpgroup's half\n", name, tid, col);
    owners[query * kD + col]++;
    return float(query * kD + col);
  });
  for (int x : owners) CHECK(x == 1, "%s: a cell of %d owners\n", name, x);
  // The writer's view: slab w = columns [64w, 64w + 64) of every row, at w slabs' size into the buffer. The atom's
  // swizzle acts on byte addresses (its smem_ptr_flag), its layout counts floats.
  typename T::SmemLayoutdQSlab slab;
  for (int w = 0; w < 2; ++w)
    for (int r = 0; r < kM; ++r)
      for (int c = 0; c < kD / 2; ++c) {
        const int at = w * int(cosize(slab)) + int(slab.layout_a()(int(sizeof(float)) * slab.layout_b()(r, c))) / 4;
        CHECK(buf[at] == float(r * kD + w * kD / 2 + c), "%s: slab %d (%d, %d) holds %g\n", name, w, r, c, buf[at]);
      }
  // Where each (thread, register) went: a warp's store instructions and their wavefronts.
  stage_all([](int tid, int i, int, int) { return float(tid * 64 + i); });
  std::map<std::pair<int, int>, std::vector<int>> instr;  // (warp, store) -> each lane's byte offset
  std::vector<int> where(256 * 64, -1);
  for (int at = 0; at < kM * kD; ++at) {
    CHECK(buf[at] >= 0, "%s: float %d not written\n", name, at);
    if (buf[at] >= 0) where[int(buf[at])] = 4 * at;
  }
  for (int tid = 0; tid < 256; ++tid)
    for (int i = 0; i < int(size(partition_fragment_C(mma, typename T::dQShape{}))); i += kWidth / 4) {
      const int first = where[tid * 64 + i];
      if (kWidth == 8) CHECK(where[tid * 64 + i + 1] == first + 4, "%s: tid %d store %d no pair\n", name, tid, i);
      instr[{tid / 32, i}].push_back(first);
    }
  long wf_total = 0, n_instr = 0;
  for (auto& [k, bytes] : instr) {
    wf_total += wavefronts(bytes, kWidth);
    ++n_instr;
  }
  const double wf = double(wf_total) / n_instr;
  printf("%s dQ staging: %d mismatches, %ld store instructions a warp, %.2f wavefronts each (%d-bit; ideal %d)\n", name,
         bad - before, n_instr / 8, wf, 8 * kWidth, kWidth / 4);
  return wf;
}

int main() {
  using T = fa2::sm90::BwdTraits<128, 80, 128, 2, fa2::DType::bf16>;
  using M = T::M;
  using N = T::N;
  using D = T::D;
  static_assert(T::kdQSwapAB && !fa2::sm90::BwdTraits<128, 64, 128, 2, fa2::DType::bf16>::kdQSwapAB);
  printf("80 x 128: sizeof(SharedStorage) %d (config.h budget %d, opt-in limit 232448); q %zu dO %zu dS %zu dq %zu "
         "lse %zu d %zu\n",
         T::kSmemSize, fa2::sm90::bwd_smem_bytes(fa2::sm90::bwd_tile(128, false)), sizeof(T::SharedStorage::q),
         sizeof(T::SharedStorage::dO), sizeof(T::SharedStorage::dS), sizeof(T::SharedStorage::dq),
         sizeof(T::SharedStorage::lse), sizeof(T::SharedStorage::d));
  CHECK(T::kSmemSize <= 232448, "shared storage over the opt-in limit\n");
  T::TiledMmaSdP mma_sdp;
  T::TiledMmadKV mma_dkv;
  T::TiledMmadQ mma_dq;

  // 1. Transposed views alias the bytes of the 80-row tiles (Q, dO, dS, dQ's staging) and K's.
  {
    T::SmemLayoutQ q;
    T::SmemLayoutQt qt;
    T::SmemLayoutdO o;
    T::SmemLayoutdOt ot;
    T::SmemLayoutdS ds;
    T::SmemLayoutdSt dst;
    T::SmemLayoutK k;
    T::SmemLayoutKt kt;
    T::SmemLayoutdQ dq;
    T::SmemLayoutdQt dqt;
    for (int s = 0; s < 2; ++s)
      for (int r = 0; r < 80; ++r)
        for (int c = 0; c < 128; ++c) {
          CHECK(qt(c, r, s) == q(r, c, s), "Q^T (%d, %d, %d)\n", c, r, s);
          CHECK(ot(c, r, s) == o(r, c, s), "dO^T (%d, %d, %d)\n", c, r, s);
          CHECK(dst(c, r, s) == ds(r, c, s), "dS^T (%d, %d, %d)\n", c, r, s);
          if (s == 0) CHECK(dqt(c, r) == dq(r, c), "dQ^T (%d, %d)\n", c, r);
        }
    for (int r = 0; r < 128; ++r)
      for (int c = 0; c < 128; ++c) CHECK(kt(c, r) == k(r, c), "K^T (%d, %d)\n", c, r);
    printf("1. transposed views: %d mismatches\n", bad);
  }

  // 2. The GEMMs' shapes and who owns what: S^T's 40 fp32 a thread (20 queries), dK/dV's 64, dQ^T's 40 with the
  // warpgroups on the head dim; P^T relabelled as dV's A operand has the (key, query) of the MMA's own A partition.
  {
    const int before = bad;
    for (int tid = 0; tid < 256; ++tid) {
      Tensor cS = mma_sdp.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<N, M>{}));  // (key, query)
      Tensor cS_rc = make_tensor(cS.data(), rowcol_t(cS.layout()));
      CHECK(size(cS) == 40 && size<0>(cS_rc) == 20, "S^T: %d values, %d queries a thread\n", int(size(cS)),
            int(size<0>(cS_rc)));
      for (int mi = 0; mi < size<0>(cS_rc); ++mi)
        for (int ni = 0; ni < size<1>(cS_rc); ++ni) {
          CHECK(get<1>(cS_rc(mi, ni)) == get<1>(cS_rc(mi, 0)), "rowcol_t: row %d is no query\n", mi);
          CHECK(get<0>(cS_rc(mi, ni)) / 64 == tid / 128, "S^T key of another warpgroup\n");
        }
      Tensor aP = make_tensor(cS.data(), as_operand_a(cS.layout()));
      Tensor aA = mma_dkv.get_thread_slice(tid).partition_A(make_identity_tensor(Shape<N, M>{}));
      CHECK(size(aP) == size(aA) && size<2>(aA) == 5, "P^T as A: %d vs %d values, %d k-blocks\n", int(size(aP)),
            int(size(aA)), int(size<2>(aA)));
      for (int i = 0; i < size(aA); ++i) CHECK(aP(i) == aA(i), "P^T as A tid %d value %d\n", tid, i);
      CHECK(size(partition_fragment_C(mma_dkv, Shape<N, D>{})) == 64, "dK/dV: not 64 fp32 a thread\n");
      Tensor cQ = mma_dq.get_thread_slice(tid).partition_C(make_identity_tensor(T::dQShape{}));  // (column, query)
      CHECK(size(cQ) == 40, "dQ^T: %d fp32 a thread\n", int(size(cQ)));
      // dQ^T's A is K^T (column, key), its B dS (query, key): the same columns as C's, whole K range.
      Tensor bdS = mma_dq.get_thread_slice(tid).partition_B(make_identity_tensor(Shape<M, N>{}));
      CHECK(size(bdS) > 0, "dQ^T B\n");
    }
    printf("2. fragments: %d mismatches\n", bad - before);
  }

  // 3. stmatrix.trans of dS^T, emulated (host_check_cute.h) in the (key, query) view: each register on its (key,
  // query), every cell of the 128 x 80 tile once.
  {
    const int before = bad;
    check_stmatrix<T::SmemCopyAtomdS, Shape<N, M>>(mma_sdp, 128, 80, "dS^T");
    printf("3. stmatrix.trans of dS^T: %d mismatches\n", bad - before);
  }

  // 4. dQ's staging, both tiles (the 64 x 128 tile's is main's, for the wavefront comparison).
  check_dq_staging<T>("80 x 128 (dQ^T)");
  check_dq_staging<fa2::sm90::BwdTraits<128, 64, 128, 2, fa2::DType::bf16>>("64 x 128 (dQ)");

  // 5. lse and D: a block's 80 floats at offset (first row & 3) stay inside the 84-float box, which starts on 16 bytes
  // for every query block (80 floats = 320 bytes).
  CHECK(T::kStatsBox == 84 && 3 + 79 < T::kStatsBox && (80 * 4) % 16 == 0 && T::kStatsBox * 4 % 16 == 0,
        "stats box\n");
  printf("5. stats box %d floats, stage %d: %s\n", T::kStatsBox, T::kStatsStage, bad ? "see above" : "ok");
  printf("%d mismatches in all\n", bad);
  return bad != 0;
}
