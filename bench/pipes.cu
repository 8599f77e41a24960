// Throughput of the instructions the forward's softmax is made of, alone and mixed: MUFU ex2 and tanh, the F2FP that
// packs P to bf16, FFMA, and mma.sync m16n8k16 (bf16). Two ops that share a pipe take the sum of their times when
// mixed; two on separate pipes take the larger. Many warps per SM (8 blocks of 8 warps), 8 independent chains per
// thread, so latency is hidden and only throughput shows. Maintainers' tool (docs/performance.md, "What bounds the
// misses"); not part of the package:
//   nvcc -O3 -arch=sm_90 -o /tmp/pipes bench/pipes.cu && /tmp/pipes
#include <cstdio>
#include <cuda_runtime.h>
__device__ __forceinline__ float ex2n(float x) { float y; asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(-x)); return y; }
__device__ __forceinline__ float tnh(float x) { float y; asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float f2fp(float a, float b) { unsigned r; asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b)); return __uint_as_float(r); }
__device__ __forceinline__ float ffma(float a, float b) { float y; asm volatile("fma.rn.ftz.f32 %0, %1, %2, %1;" : "=f"(y) : "f"(a), "f"(b)); return y; }
__device__ __forceinline__ void hmma(float (&acc)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                     unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <int kEx2, int kTanh, int kF2fp, int kFma, int kHmma = 0>
__global__ void k(float* out, int iters) {
  float a[8], b[8], c[8], d[8];
  float acc[8][4] = {};
  unsigned ra = 0x3f803f80u ^ threadIdx.x, rb = 0x3f003f00u;
  for (int i = 0; i < 8; ++i) a[i] = b[i] = c[i] = d[i] = 0.3f + 0.01f * (threadIdx.x + i);
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int r = 0; r < kEx2; ++r) a[i] = ex2n(a[i]);
#pragma unroll
      for (int r = 0; r < kTanh; ++r) b[i] = tnh(b[i]);
#pragma unroll
      for (int r = 0; r < kF2fp; ++r) c[i] = f2fp(c[i], a[i]);
#pragma unroll
      for (int r = 0; r < kFma; ++r) d[i] = ffma(d[i], 0.999f);
#pragma unroll
      for (int r = 0; r < kHmma; ++r) hmma(acc[i], ra, ra, ra, ra, rb, rb);
    }
  }
  float s = 0; for (int i = 0; i < 8; ++i) s += a[i] + b[i] + c[i] + d[i] + acc[i][0] + acc[i][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
template <int E, int T, int F, int M, int H = 0>
void run(const char* name, float* out) {
  int iters = 2048, blocks = 132 * 8, threads = 256;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  k<E, T, F, M, H><<<blocks, threads>>>(out, iters);
  cudaEventRecord(e0);
  k<E, T, F, M, H><<<blocks, threads>>>(out, iters);
  cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  double warp_instr_per_sm = double(blocks) * threads / 32 * iters * 8 / 132;  // of each listed op, per SM
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  double cycles = ms * 1e-3 * clk * 1e3;
  // Per (chain, iteration): the ops listed; "lanes/clk/SM" counts each listed op once (a mix of two ops at the rate of
  // one of them alone has its lanes halved).
  printf("%-20s hmma %d ex2 %d tanh %d f2fp %d ffma %d: %8.3f ms, %6.2f SM cycles per warp-iteration; "
         "lanes/clk/SM per listed op %.2f\n", name, H, E, T, F, M, ms, cycles / (warp_instr_per_sm / 8),
         warp_instr_per_sm * 32 / cycles);
}
int main() {
  float* out; cudaMalloc(&out, 132 * 8 * 256 * 4);
  run<1, 0, 0, 0>("ex2", out);
  run<0, 1, 0, 0>("tanh", out);
  run<0, 0, 1, 0>("f2fp", out);
  run<0, 0, 0, 1>("ffma", out);
  run<1, 1, 0, 0>("ex2+tanh", out);
  run<1, 0, 1, 0>("ex2+f2fp", out);
  run<2, 0, 1, 0>("2ex2+f2fp", out);
  run<1, 1, 1, 0>("ex2+tanh+f2fp", out);
  run<1, 0, 0, 4>("ex2+4ffma", out);
  run<0, 0, 1, 4>("f2fp+4ffma", out);
  run<0, 0, 0, 0, 1>("hmma", out);
  run<1, 0, 0, 0, 1>("hmma+ex2", out);
  run<2, 0, 0, 0, 1>("hmma+2ex2", out);
  run<2, 0, 1, 0, 1>("hmma+2ex2+f2fp", out);
  run<1, 1, 1, 0, 1>("hmma+ex2+tanh+f2fp", out);
  int clk; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0); printf("clock attr %d kHz\n", clk);
  return 0;
}
