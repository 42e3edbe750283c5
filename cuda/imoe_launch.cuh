// imoe_launch.cuh: the host side every kernel family shares (definitions in
// imoe_launch.cu): the device table, errors, call tokens, the device guard,
// one launch helper, the call's rows (lead axes merged over every view) and
// the kernel views built from imoe_views, plus the launch steps one family
// lends another (docs/cuda-design.md, "Files" and "The path of one call").
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <mutex>
#include <vector>

#include "imoe_backend.h"
#include "imoe_device.cuh"

namespace imoe_cu {

// ------------------------------------------------------------ device table
constexpr int kMaxDevices = 64;

// Per device, filled once by enter(): attributes, and the select family's
// setup (setup_select_device in imoe_select.cu).
struct DevInfo {
  bool init;
  int sms;
  int smem_optin;  // per block, opt-in
  int smem_sm;     // per multiprocessor
  int cc_major;
  int coop;      // cooperative launches (the select's own NaN check, k_select_wide)
  int wide_cap;  // k_select_wide: pairs a block holds at once (H and T in shared memory)
  size_t occ_smem[8];  // occupancy cache per select path (SelectPath), for that shared memory
  int occ_val[8];
  StatusWords words;  // the status and verdict words (imoe_select.cu's module memory)
};

extern std::mutex g_mu;  // guards g_dev
extern DevInfo g_dev[kMaxDevices];

// Sets the select family's kernel attributes and reads its module memory's
// addresses into di (once per device, under g_mu). On failure, *what names
// the runtime call that failed.
cudaError_t setup_select_device(DevInfo *di, const char **what);

// ------------------------------------------------------------ errors, tokens
imoe_status fail(imoe_error *err, imoe_status st, const char *fmt, ...);
// A runtime failure: IMOE_ERR_DEVICE, and the CUDA error cleared.
imoe_status cuda_fail(imoe_error *err, const char *fn, const char *what, cudaError_t e);
// A call's verdict token: never 0, unique across every translation unit.
uint32_t next_token();

// Makes exec->device_id current for the call and restores the caller's.
struct DeviceGuard {
  int prev = -1;
  bool switched = false;
  ~DeviceGuard() {
    if (switched) cudaSetDevice(prev);
  }
};

// The start of every launcher: the call's device made current (g restores
// the caller's), its entry of the device table, set up on first use.
imoe_status enter(const imoe_exec *exec, const char *fn, imoe_error *err, DeviceGuard *g, DevInfo **out);

// ------------------------------------------------------------ launches
// The shape of one launch, as a plan decides it. pdl: programmatic dependent
// launch after the previous kernel; coop: a cooperative launch (every block
// resident at once, or the launch fails).
struct LaunchShape {
  unsigned grid;
  unsigned block;
  size_t smem;
  bool pdl;
  bool coop;
};

inline LaunchShape shape(unsigned grid, unsigned block, size_t smem = 0, bool pdl = false,
                         bool coop = false) {
  LaunchShape s;
  s.grid = grid;
  s.block = block;
  s.smem = smem;
  s.pdl = pdl;
  s.coop = coop;
  return s;
}

template <class... P, class... A>
cudaError_t launch(void (*kernel)(P...), const LaunchShape &s, cudaStream_t st, const A &...args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(s.grid, 1, 1);
  cfg.blockDim = dim3(s.block, 1, 1);
  cfg.dynamicSmemBytes = s.smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (s.pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (s.coop) {
    attr[n].id = cudaLaunchAttributeCooperative;
    attr[n++].val.cooperative = 1;
  }
  cfg.attrs = n ? attr : nullptr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// ------------------------------------------------------------ views
int64_t dtype_size(int dt);

// The lead axes of every view of a call, merged where all views are
// contiguous across them and with size-1 axes dropped. A view with
// lead_ndim 0 (shared active indices) is broadcast (stride 0).
struct CallRows {
  Lead lead;
  uint64_t R;
  std::vector<Strides> st;  // one per view, in the order given
};

// false: more than 2^32 - 1 rows.
bool merge_rows(const imoe_view *ref, const std::vector<const imoe_view *> &views, CallRows *pl);

InView in_view(const imoe_view *v, const Strides &st, int nd);
OutView out_view(const imoe_view *v, const Strides &st, int nd);
// A buffer's descriptor: the widest vector that divides every slot and lead
// stride, and the row cut into head bytes, body vectors and tail bytes.
BufDesc buf_desc(const imoe_view *v, const Strides &st, int nd);

// Byte range [lo, hi) a view touches.
void extent(const imoe_view *v, const CallRows &pl, const Strides &st, int64_t n, int64_t row_bytes,
            uintptr_t *lo, uintptr_t *hi);
inline bool overlaps(uintptr_t alo, uintptr_t ahi, uintptr_t blo, uintptr_t bhi) {
  return alo < bhi && blo < ahi;
}

// ------------------------------------------------------------ workspaces
// A row-major [plan rows, n] int32 region of a caller's workspace as a view
// over the merged lead axes (all strides zero for a shared plan).
InView ws_view(const int32_t *data, const Lead &lead, int64_t n, bool per_row);
imoe_status check_workspace(const char *fn, int32_t *ws, int64_t elems, int64_t need, imoe_error *err);

// ------------------------------------------------------------ steps families share
// The validation verdict of a select_and_move call: later kernels of the
// same call (ordered compaction) read it with call_aborted(words, token, nverdict).
struct SelectVerdict {
  uint32_t token;
  int nverdict;
};

// imoe_select.cu. build_map (num_buffers == 0, do_move false) and compact.
// `verdict`, when given, receives the call's verdict token (0: nothing was
// validated).
imoe_status select_and_move(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                            const imoe_selection *sel, const imoe_view *oi, const imoe_view *otm,
                            bool do_move, imoe_mode mode, const imoe_exec *exec, imoe_error *err,
                            SelectVerdict *verdict = nullptr);

// imoe_select.cu. k_apply for buffer groups [first, num_buffers), kMaxBuf a
// launch: the map (kind 0 indices, 1 target_map) of M entries per row,
// after the validation of `token`.
imoe_status launch_apply_groups(const char *fn, const imoe_view *buffers, int first, int num_buffers,
                                const CallRows &pl, size_t buf_st0, const InView &map, int kind, int64_t M,
                                bool swap, uint32_t token, int nverdict, bool pdl_first, DevInfo *di,
                                cudaStream_t st, imoe_error *err);

// imoe_permute.cu. The permutation `succ` ([plan rows, n]) applied to
// buffers [buf_st0, ...) of pl after the validation of `token`: by column
// slices in shared memory (launch_slices) where every buffer's slot slice
// fits, else by the cycle kernels and the data passes. `written` < n (a
// forward permutation only): slots [written, n) may be left as they are
// (move mode: only new[0, written) is wanted); the cycle engine writes all.
imoe_status launch_cycles_and_swaps(const char *fn, const imoe_view *buffers, int32_t num_buffers,
                                    const CallRows &pl, size_t buf_st0, const InView &succ, bool per_row,
                                    int64_t n, bool inverse, int32_t *ws, uint32_t token, int nverdict,
                                    DevInfo *di, cudaStream_t st, imoe_error *err, int64_t written = -1);

// imoe_slices.cu. The same permutation, one block per (rows, slices) unit
// staging in shared memory the slices of the slots it writes (forward: the
// sources of new[0, written); inverse: all n). *done = false, with nothing
// launched, when some buffer's staged slots x W bytes do not fit a block.
imoe_status launch_slices(const char *fn, const imoe_view *buffers, int32_t num_buffers, const CallRows &pl,
                          size_t buf_st0, const InView &succ, bool per_row, int64_t n, int64_t written,
                          bool inverse, uint32_t token, int nverdict, DevInfo *di, cudaStream_t st,
                          imoe_error *err, bool *done);

}  // namespace imoe_cu
