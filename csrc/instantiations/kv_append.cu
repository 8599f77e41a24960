// The KV-cache append (kv_append.h), one instantiation for every head dim and dtype: it moves bytes.
#include "common/kv_append.h"
#include "common/launch.h"

namespace fa2 {

void run_kv_append(const KvAppendParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_new == 0) return;
  kv_append_kernel<<<dim3(p.seqlen_new, p.batch, kv_append_parts(p)), kAppendThreads, 0, stream>>>(p);
  check_cuda(cudaGetLastError(), "kv append launch");
}

int device_code_arch() { return kernel_code_arch<&kv_append_kernel>(); }

}  // namespace fa2
