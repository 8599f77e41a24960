// The kernels' tuning, per head dim, in one place: tiles, warps, pipeline stages, and the alternative
// configurations the launch picks at run time (fwd_launch.h, bwd_launch.h) from the sequence lengths and from
// the shared memory a block may use. Traits (traits.h) derive layouts from these numbers; kernels never see them.
// The measurements behind each choice are in bench/NOTES.md under the tag given.
//
// Shared memory per block, which decides what fits: A100 163 KB, H100 227 KB; sm86, sm89 and sm120 (RTX 30xx,
// 40xx, 50xx; A10, L4, L40) 99 KB. Every head dim has a configuration that fits 99 KB, forward and backward.
#pragma once

namespace fa2 {

inline constexpr int kSmemConsumerGpu = 99 * 1024;  // the smallest opt-in limit fa2 supports (sm86/89/120)

// ------------------------------------------------------------------------------------------------ forward
// (kBlockM, kBlockN, warps, K/V stages). Each thread holds kBlockM/(16*warps)*2 rows of acc_o (head_dim/4
// floats each) and of S (kBlockN/4 floats each); past ~255 registers the kernel spills, so wide heads get
// narrower K/V tiles or more warps. Stages = K/V buffers each: 1 is FA2's schedule (two barriers per key block,
// each refill behind one); 2 gives one barrier per block with block n-1's K and V loading during all of block
// n's work, which pays where registers allow it (d64, d96) and loses to spills where they do not (d128, d256;
// NOTES v9, v10, v11). Other head dims are unmeasured and keep 1.
template <int kHeadDim> struct FwdConfig;
template <> struct FwdConfig<32>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<64>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2; };
template <> struct FwdConfig<96>  { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 2; };
template <> struct FwdConfig<128> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<160> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4, kStages = 1; };
template <> struct FwdConfig<192> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
template <> struct FwdConfig<224> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
template <> struct FwdConfig<256> { static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8, kStages = 1; };
// With two stages, unroll the key-block loop by two so each half reads a fixed buffer (immediate ldmatrix
// offsets). It costs registers: d64 has them to spare, d96 spills (NOTES v11).
template <int kHeadDim> constexpr bool kFwdUnrollStages = kHeadDim == 64;

// The narrow forward tile, FA2's 64 x 64 on 4 warps (two CTAs per SM), where FwdConfig's 8-warp tile does not pay
// or does not fit:
// - short sequences at d256 (max(seqlen_q, seqlen_k) up to kMaxSeqlen, or kMaxSeqlenCausal when causal), where the
//   8-warp tile's one CTA per SM leaves its Q load, barriers and epilogue exposed (NOTES v10, v12);
// - any sequence where FwdConfig's tile needs more shared memory than a block may use: d224 and d256 on 99 KB
//   GPUs (the other head dims' FwdConfig fit).
template <int kHeadDim> struct FwdNarrowConfig {
  static constexpr bool kEnabled = kHeadDim == 224 || kHeadDim == 256;
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4, kStages = 1;
  static constexpr int kMaxSeqlen = kHeadDim == 256 ? 1024 : 0, kMaxSeqlenCausal = kHeadDim == 256 ? 2048 : 0;
};

// ------------------------------------------------------------------------------------------------ backward
// (kBlockM, kBlockN, Q/dO stages) per head dim, on 8 warps. dK and dV live in registers for the whole CTA
// (2 * kBlockN * head_dim / 256 floats per thread), so wide heads get narrower key blocks, and one Q/dO buffer
// keeps shared memory under an A100's 163 KB. head_dim 64 takes 128 query rows per block (S/dP in two 64-row
// passes, traits.h): the dQ GEMM's warps get 32 x 32 slabs and a block pays its barriers once per 128 rows
// (NOTES v8).
// kStagesBigSmem: the Q/dO stages where a block may use more than an A100 allows (H100); d256's second stage
// needs 208 KB and pays there, as FA2 also chooses at run time (NOTES v10). Other head dims: not measured.
// kRunningQdO (traits.h): running Q/dO source tiles instead of indexed loads, per head dim since it moves
// registers: it pays at d128, loses at d96 and d64 and is neutral at d256 (NOTES v12); others unmeasured.
template <int kHeadDim> struct BwdConfig {
  static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kStages = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kStagesBigSmem = kHeadDim == 256 ? 2 : kStages;
  static constexpr bool kRunningQdO = kHeadDim == 128;
};

// The backward where BwdConfig's tiles need more shared memory than a block may use: 99 KB GPUs at d64, d96,
// d128, d192, d224 and d256 (d32 and d160 fit as they are). Each takes the largest tiles that fit, then a
// second Q/dO stage if that fits too: 64 query rows, 128 keys at d64, 64 at d96/d128, 32 from d192. At d256
// even 64 x 32 tiles need 104 KB, so P and dS move into the bytes of V (kPdSInV, traits.h), which then reloads
// with every query block. d224 runs that d256 kernel (kKernelHeadDim; the last 32 columns are masked, as for any
// head dim between compiled sizes): 8 warps cannot copy a 32-row tile of 224 columns in whole passes (it is
// 3.5 of them), and 64 rows do not fit. These configurations are correct by test on the H100 (a forced limit)
// but not tuned: no 99 KB GPU is at hand.
template <int kHeadDim> struct BwdSmallSmemConfig {
  static constexpr bool kEnabled = kHeadDim != 32 && kHeadDim != 160;
  static constexpr int kKernelHeadDim = kHeadDim == 224 ? 256 : kHeadDim;
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = kHeadDim == 64 ? 128 : kHeadDim <= 128 ? 64 : 32;
  static constexpr int kStages = kHeadDim <= 96 ? 2 : 1;
  static constexpr bool kPdSInV = kKernelHeadDim == 256;
};

}  // namespace fa2
