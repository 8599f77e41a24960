// Host-only check of the Hopper backward's dQ staging stores (csrc/sm90/bwd_kernel.h: dq_byte and the odd-row
// permutation): every address equals CuTe's position-independent swizzle tensor's for the same element, every float of
// a warp's slab is written once, and the wavefronts per 64-bit store instruction (served by half-warps: per half, the
// most distinct words one bank delivers) come out.
//   CUT=$(python -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__)+'/source/include')")
//   nvcc -std=c++17 -I$CUT -Icsrc --expt-relaxed-constexpr -arch=sm_90a -o /tmp/dq_banks bench/dq_banks.cu
//   /tmp/dq_banks   # d64 / d128: 0 mismatches, 2.00 wavefronts (the unpermuted order: 4.00, as ncu measured)
// (On the host CuTe prints "cast_smem_ptr_to_uint not supported" once per head dim; the addresses still compare.)
#include <cstdio>
#include <map>
#include <set>
#include <cstdint>
#include "sm90/bwd_traits.h"
using namespace cute;
template <class Layout>
auto rowcol(Layout const& l) {  // sm90/utils.h's, host-side
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

template <int D>
int run() {
  using T = fa2::sm90::BwdTraits<D, 64, 128, 2, fa2::DType::bf16>;
  using M = Int<64>;
  typename T::TiledMmadQ mma;
  alignas(1024) static float buf[64 * D];
  Tensor sdQ = make_tensor(make_smem_ptr(buf), typename T::SmemLayoutdQ{});
  Tensor sdQ_pi = as_position_independent_swizzle_tensor(sdQ);
  int bad = 0; long wf_total = 0, n_instr = 0;
  for (int warp = 0; warp < 8; ++warp) {
    std::map<std::pair<int,int>, std::vector<int>> slots;
    std::set<int> written;
    for (int lane = 0; lane < 32; ++lane) {
      int tid = warp * 32 + lane;
      auto thr_dq = mma.get_thread_slice(tid);
      Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<M, Int<D>>{}));
      Tensor cdQ_rc = make_tensor(cdQ.data(), rowcol(cdQ.layout()));
      const bool odd_row = get<0>(cdQ_rc(0, 0)) % 2;
      auto dq_byte = [&](int h, int c) {
        constexpr typename T::SmemLayoutdQ layout{};
        return layout.layout_a()(int(sizeof(float)) * layout.layout_b()(cdQ_rc(h, c)));
      };
      for (int h = 0; h < 2; ++h)
        for (int g = 0; g < size<1>(cdQ_rc) / 2; ++g) {
          int gs = g ^ 2, c = 2 * g, cs = 2 * gs;
          int cc = odd_row ? cs : c;
          int byte = odd_row ? dq_byte(h, cs) : dq_byte(h, c);
          for (int e = 0; e < 2; ++e) {
            float* want = &sdQ_pi(cdQ_rc(h, cc + e));
            int got = byte + 4 * e;
            if ((char*)want - (char*)buf != got) ++bad;
            written.insert(got);
          }
          slots[{h, g}].push_back(byte / 4);
        }
    }
    if ((int)written.size() != 2 * 32 * 2 * (D / 16)) ++bad;  // each float of the warp's 16 x D/2 written once
    // A 64-bit shared store is served by half-warps: per half, the most distinct words one bank must deliver.
    for (auto& [k, offs] : slots) {
      for (int half = 0; half < 2; ++half) {
        std::map<int, std::set<int>> bank;
        for (int l = 16 * half; l < 16 * half + 16; ++l)
          for (int e = 0; e < 2; ++e) bank[(offs[l] + e) % 32].insert(offs[l] + e);
        int wf = 0;
        for (auto& [b, s] : bank) wf = std::max<int>(wf, s.size());
        wf_total += wf;
      }
      ++n_instr;
    }
  }
  printf("d%d: %d mismatches, %.2f wavefronts per store instruction (ideal 2)\n", D, bad, double(wf_total) / n_instr);
  return bad;
}
int main() { return run<64>() + run<128>(); }
