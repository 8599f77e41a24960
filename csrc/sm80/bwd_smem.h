// Where each operand lives in the dynamic shared memory of the two backward main loops (bwd_kernel.h): Q and dO
// (kStages buffers each), K, V, then P and dS (in the bytes of V where Traits::kPdSInV), then the warps' own dQ
// slabs where the code uses them (dq_accum.h).
#pragma once

#include <cute/tensor.hpp>

namespace fa2 {
using namespace cute;

template <typename Traits>
struct BwdSmem {
  using Element = typename Traits::Element;
  Element* base;
  __device__ explicit BwdSmem(char* smem) : base(reinterpret_cast<Element*>(smem)) {}
  __device__ Element* q(int stage) const { return base + stage * Traits::kQdOElems; }
  __device__ Element* dout(int stage) const { return base + (Traits::kStages + stage) * Traits::kQdOElems; }
  __device__ Element* k() const { return base + 2 * Traits::kStages * Traits::kQdOElems; }
  __device__ Element* v() const { return k() + Traits::kKVElems; }
  __device__ Element* p() const { return Traits::kPdSInV ? v() : v() + Traits::kKVElems; }
  __device__ Element* ds() const { return p() + Traits::kPdSElems; }
  // Past kSmemSize: the warps' own dQ slabs (Traits::kDqWarpStageBytes), allocated only where the code uses them.
  __device__ float* dq_slabs() const { return reinterpret_cast<float*>(ds() + Traits::kPdSElems); }
  template <typename Layout>
  __device__ static auto tensor(Element* ptr, Layout layout) { return make_tensor(make_smem_ptr(ptr), layout); }
};

}  // namespace fa2
