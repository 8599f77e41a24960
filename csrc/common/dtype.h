// The two input precisions, as a tag the host code can name without pulling in CUTLASS.
#pragma once

namespace fa2 {
enum class DType { fp16, bf16 };
constexpr const char* dtype_name(DType t) { return t == DType::fp16 ? "fp16" : "bf16"; }
}  // namespace fa2
