// imoe_select_common.cuh: what the select family's kernels share (k_check_*,
// k_select, k_select_small, k_select_wide, k_apply): the select parameters,
// the family's fixed module memory (the device status word, the verdict
// words, the NaN check's grid-barrier words) and the protocol of the select's
// own NaN check (docs/cuda-design.md, "Data errors").
//
// This header DEFINES module memory: it belongs to imoe_select.cu alone. A
// second translation unit including it would get copies of its own (without
// relocatable device code every __device__ variable is per translation
// unit), and its verdicts would never be seen; other families reach the
// words through the addresses in DevInfo::words.
#pragma once

#ifndef IMOE_SELECT_TRANSLATION_UNIT
#error "imoe_select_common.cuh defines the select family's module memory: include it from imoe_select.cu only"
#endif

#include "imoe_device.cuh"

namespace imoe_cu {

__device__ int g_status;        // first data error since the last read
__device__ int g_status_taken;  // staging for imoe_cuda_read_device_status
// Verdicts of a call's validation kernel: block b of call t writes
// g_verdict[t % kSlots][b] = (it found an error) ? t : 0, unconditionally, so
// a replay of a captured call starts from its own verdicts (no clearing, no
// counters). The validation grid has at most kVerdicts blocks (grid-stride).
__device__ unsigned g_verdict[kSlots][kVerdicts];
// Per call slot: the grid barrier of the NaN check that k_select_small and
// k_select_wide make themselves (a cooperative launch, see select_and_move;
// the helpers nan_arrive and nan_verdict). Bits 32-63: a sense-reversing
// arrival counter (block 0 adds 2^31 - (grid - 1), every other block 1, so
// bit 63 flips once every block has arrived and bits 32-62 return to their
// value). Bits 0-15 and 16-31: blocks that found a NaN, for launches whose
// bit 63 was 0 and 1 before they arrived; a launch clears the half its
// successor on the slot will use. The count travels in the arrival's own
// atomic, so the value that shows the flip shows every block's finding.
__device__ unsigned long long g_gridbar[kSlots];

}  // namespace imoe_cu

// Timing probes (diagnosis only): compiled in when the build defines
// IMOE_PHASE_TIMES, no-ops otherwise. Their stamps follow the words above in
// module memory.
#ifdef IMOE_PHASE_TIMES
#include "debug_phase_times.cuh"
#else
#define IMOE_PHASE(k) ((void)0)
#define IMOE_PHASE_WAIT_KEYS(key0, sink) ((void)0)
#define IMOE_PHASE_PAIRS(tid, np) ((void)0)
#define IMOE_PHASE_END(k) ((void)0)
#endif

namespace imoe_cu {

// The status and verdict words of this module, as the helpers of
// imoe_device.cuh take them (their addresses are constants here).
__device__ __forceinline__ StatusWords module_words() {
  StatusWords w;
  w.status = &g_status;
  w.verdict = g_verdict;
  return w;
}

__global__ void k_take_status() { g_status_taken = atomicExch(&g_status, 0); }

__device__ __forceinline__ unsigned long long ld_relaxed_u64(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// ------------------------------------------------------------ select parameters
// k_select, k_select_small and k_select_wide: one struct, filled by
// select_and_move from the call's select plan.
struct SelParams {
  Lead lead;
  int64_t N;  // < 0 (active only): unknown, taken as max(C', max index + 1)
  int64_t Cp, P, W, K;
  int32_t nblk;      // blocks per row
  int32_t cap;       // ring capacity (entries)
  int32_t nk;        // SRC 0: keys held in shared memory (multiple of kTile)
  int32_t win_bits;  // SRC 2: bits per window
  int32_t two_win;   // SRC 2: one window per phase, rebuilt as it advances
  int32_t has_idx, has_tm;
  int32_t do_move, swap, nbuf;
  int32_t pdl;
  int32_t nverdict;     // blocks of the validation kernel (verdict words)
  int32_t fused_nan;    // k_select_small checks every row for NaN itself (cooperative launch)
  uint32_t token;
  InView scores, active;
  OutView idx, tm;
  BufDesc buf[kMaxBuf];
  int32_t wslot;  // k_select_wide: its slot of module memory (imoe_select_wide.cuh)
};

// ------------------------------------------------------------ fused NaN check
// (k_select_small and k_select_wide; the protocol: g_gridbar above)
// The fused NaN check's arrival (thread 0): this block's finding goes into
// the half of the grid barrier word that bit 63 (read before arriving) names.
__device__ __forceinline__ void nan_arrive(unsigned long long *gbar, int ph, bool row_nan) {
  const unsigned long long G = gridDim.x;
  unsigned long long inc = blockIdx.x == 0 ? (0x80000000ull - (G - 1ull)) << 32 : 1ull << 32;
  if (row_nan) inc += 1ull << (16 * ph);
  atomicAdd(gbar, inc);
}

// The fused NaN check's verdict (thread 0), from `seen`, a read of the word
// made after arriving: waits until every block has arrived; true when some
// block found a NaN. Block 0 clears the half the next launch on the slot
// uses, records the status and writes verdict word 0.
__device__ __forceinline__ bool nan_verdict(unsigned long long *gbar, int ph, uint32_t token,
                                            unsigned long long seen) {
  while ((int)(seen >> 63) == ph) {  // not every block has arrived
    __nanosleep(100);
    seen = ld_relaxed_u64(gbar);
  }
  const bool bad = ((seen >> (16 * ph)) & 0xFFFFull) != 0ull;
  if (blockIdx.x == 0) {
    atomicAnd(gbar, ~(0xFFFFull << (16 * (ph ^ 1))));  // the next launch's half
    if (bad) record_status(module_words(), IMOE_ERR_NAN);
    g_verdict[token % kSlots][0] = bad ? token : 0u;  // for the call's later kernels
  }
  return bad;
}

}  // namespace imoe_cu
