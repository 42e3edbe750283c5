// debug_phase_times.cuh: timing probes of k_select_small and k_select_wide
// (diagnosis only). Included by imoe_select_common.cuh when the build defines
// IMOE_PHASE_TIMES (tests/cuda/harness.cu --phases); a default build never
// sees this file and its kernels carry no probe. Thread 0 of each block
// stamps the SM clock and the global timer at the end of each phase, and in
// the spare stamps its SM and its number of pairs; imoe_cuda_phase_read()
// copies the stamps out. The stamps cost ~1 us of W1 themselves.
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace imoe_cu {

constexpr int kPhaseBlocks = 1024, kPhases = 12;  // stamps: [kPhaseBlocks][2][kPhases]

__device__ unsigned long long g_phase[kPhaseBlocks][2][kPhases];
__device__ __forceinline__ void phase_stamp(int k) {
  if (threadIdx.x == 0 && blockIdx.x < kPhaseBlocks) {
    unsigned long long gt;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(gt));
    g_phase[blockIdx.x][0][k] = (unsigned long long)clock64();
    g_phase[blockIdx.x][1][k] = gt;
    if (k == 0) {  // the block's SM, in the spare stamp
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      g_phase[blockIdx.x][0][kPhases - 1] = smid;
    }
  }
}

}  // namespace imoe_cu

#define IMOE_PHASE(k) imoe_cu::phase_stamp(k)
// the stamp after the key load waits for the keys: a store that depends on one
#define IMOE_PHASE_WAIT_KEYS(key0, sink)   \
  do {                                     \
    if ((key0) == 0xDEADBEEFu) (sink) = 1; \
  } while (0)
// the spare stamp of the timer row: the block's number of pairs (thread tid)
#define IMOE_PHASE_PAIRS(tid, np)                                                       \
  do {                                                                                  \
    if ((tid) == 0 && blockIdx.x < imoe_cu::kPhaseBlocks)                               \
      imoe_cu::g_phase[blockIdx.x][1][imoe_cu::kPhases - 1] = (unsigned long long)(np); \
  } while (0)
// the last stamp, once every thread of the block is done
#define IMOE_PHASE_END(k) \
  do {                    \
    __syncthreads();      \
    IMOE_PHASE(k);        \
  } while (0)

// Copies the stamps ([kPhaseBlocks][2][kPhases]: clock64, then globaltimer)
// into out, then zeroes them when reset is set. Synchronises the device.
extern "C" int imoe_cuda_phase_read(unsigned long long *out, int reset) {
  const size_t n = sizeof(unsigned long long) * imoe_cu::kPhaseBlocks * 2 * imoe_cu::kPhases;
  if (out && cudaMemcpyFromSymbol(out, imoe_cu::g_phase, n) != cudaSuccess) return -1;
  if (reset) {
    std::vector<unsigned long long> z((size_t)imoe_cu::kPhaseBlocks * 2 * imoe_cu::kPhases, 0ull);
    if (cudaMemcpyToSymbol(imoe_cu::g_phase, z.data(), n) != cudaSuccess) return -1;
  }
  return 0;
}
