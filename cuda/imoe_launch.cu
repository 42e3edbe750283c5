// imoe_launch.cu: the host side every kernel family shares (imoe_launch.cuh):
// the device table, errors and tokens, the call's rows and the kernel views.
#include "imoe_launch.cuh"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <mutex>

namespace imoe_cu {

std::mutex g_mu;
DevInfo g_dev[kMaxDevices];

namespace {
std::atomic<uint32_t> g_token{0};
bool multiple_of(int64_t v, int64_t a) { return v % a == 0; }
}  // namespace

imoe_status fail(imoe_error *err, imoe_status st, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
  }
  return st;
}

imoe_status cuda_fail(imoe_error *err, const char *fn, const char *what, cudaError_t e) {
  (void)cudaGetLastError();  // a failed launch must not linger as the "last error"
  return fail(err, IMOE_ERR_DEVICE, "%s: %s failed: %s (%s)", fn, what, cudaGetErrorString(e),
              cudaGetErrorName(e));
}

uint32_t next_token() {
  uint32_t t;
  do {
    t = g_token.fetch_add(1u) + 1u;
  } while (t == 0u);
  return t;
}

imoe_status enter(const imoe_exec *exec, const char *fn, imoe_error *err, DeviceGuard *g, DevInfo **out) {
  int cur = 0;
  cudaError_t e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return cuda_fail(err, fn, "cudaGetDevice", e);
  const int dev = exec->device_id;
  if (dev < 0 || dev >= kMaxDevices)
    return fail(err, IMOE_ERR_ARGUMENT, "%s: exec->device_id %d out of range", fn, dev);
  if (cur != dev) {
    e = cudaSetDevice(dev);
    if (e != cudaSuccess) return cuda_fail(err, fn, "cudaSetDevice", e);
    g->prev = cur;
    g->switched = true;
  }
  DevInfo *di = &g_dev[dev];
  std::lock_guard<std::mutex> lock(g_mu);
  if (!di->init) {
    int v[5];
    const cudaDeviceAttr attrs[5] = {cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                     cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                     cudaDevAttrComputeCapabilityMajor, cudaDevAttrCooperativeLaunch};
    for (int i = 0; i < 5; ++i) {
      e = cudaDeviceGetAttribute(&v[i], attrs[i], dev);
      if (e != cudaSuccess) return cuda_fail(err, fn, "cudaDeviceGetAttribute", e);
    }
    di->sms = v[0];
    di->smem_optin = v[1];
    di->smem_sm = v[2];
    di->cc_major = v[3];
    di->coop = v[4];
    const char *what = "";
    if ((e = setup_select_device(di, &what)) != cudaSuccess) return cuda_fail(err, fn, what, e);
    di->init = true;
  }
  *out = di;
  return IMOE_OK;
}

// ------------------------------------------------------------ views
int64_t dtype_size(int dt) {
  switch (dt) {
    case IMOE_DTYPE_F32: return 4;
    case IMOE_DTYPE_F16: return 2;
    case IMOE_DTYPE_BF16: return 2;
    case IMOE_DTYPE_I32: return 4;
    case IMOE_DTYPE_I64: return 8;
    default: return 1;
  }
}

bool merge_rows(const imoe_view *ref, const std::vector<const imoe_view *> &views, CallRows *pl) {
  const int nd = ref ? ref->lead_ndim : 0;
  const size_t nv = views.size();
  int64_t shape[kMaxDims];
  std::vector<Strides> src(nv);
  uint64_t R = 1;
  for (int d = 0; d < nd; ++d) {
    shape[d] = ref->lead_shape[d];
    R *= (uint64_t)shape[d];
    for (size_t i = 0; i < nv; ++i)
      src[i].s[d] = (views[i] && views[i]->lead_ndim > 0) ? views[i]->lead_stride[d] : 0;
  }
  pl->R = R;
  pl->st.assign(nv, Strides());
  for (size_t i = 0; i < nv; ++i) memset(&pl->st[i], 0, sizeof(Strides));
  memset(&pl->lead, 0, sizeof(Lead));
  if (R == 0) return true;
  if (R > 0xFFFFFFFFull) return false;
  int m = 0;
  uint64_t mshape[kMaxDims];
  for (int d = 0; d < nd; ++d) {
    if (shape[d] == 1) continue;
    bool merge = m > 0;
    for (size_t i = 0; merge && i < nv; ++i)
      if (pl->st[i].s[m - 1] != src[i].s[d] * shape[d]) merge = false;
    if (merge) {
      mshape[m - 1] *= (uint64_t)shape[d];
      for (size_t i = 0; i < nv; ++i) pl->st[i].s[m - 1] = src[i].s[d];
    } else {
      mshape[m] = (uint64_t)shape[d];
      for (size_t i = 0; i < nv; ++i) pl->st[i].s[m] = src[i].s[d];
      ++m;
    }
  }
  pl->lead.nd = m;
  for (int d = 0; d < m; ++d) pl->lead.shape[d] = (uint32_t)mshape[d];
  return true;
}

InView in_view(const imoe_view *v, const Strides &st, int nd) {
  InView o;
  memset(&o, 0, sizeof o);
  if (!v) return o;
  o.data = static_cast<const char *>(v->data);
  o.lead = st;
  o.n_stride = v->n_stride;
  o.dtype = v->dtype;
  const int64_t es = dtype_size(v->dtype);
  bool al = multiple_of((int64_t)(uintptr_t)v->data, es) && multiple_of(v->n_stride, es);
  for (int d = 0; d < nd; ++d) al = al && multiple_of(st.s[d], es);
  o.aligned = al ? 1 : 0;
  return o;
}

OutView out_view(const imoe_view *v, const Strides &st, int nd) {
  const InView i = in_view(v, st, nd);
  OutView o;
  o.data = const_cast<char *>(i.data);
  o.lead = i.lead;
  o.n_stride = i.n_stride;
  o.dtype = i.dtype;
  o.aligned = i.aligned;
  return o;
}

BufDesc buf_desc(const imoe_view *v, const Strides &st, int nd) {
  BufDesc b;
  memset(&b, 0, sizeof b);
  b.data = static_cast<char *>(v->data);
  b.lead = st;
  b.n_stride = v->n_stride;
  int vw = 16;
  while (vw > 1) {
    bool ok = multiple_of(v->n_stride, vw);
    for (int d = 0; d < nd; ++d) ok = ok && multiple_of(st.s[d], vw);
    if (ok) break;
    vw >>= 1;
  }
  const int64_t rb = v->row_bytes;
  const int64_t mis = (int64_t)((uintptr_t)v->data % (uintptr_t)vw);
  int64_t head = mis ? vw - mis : 0;
  if (head > rb) head = rb;
  const int64_t body = (rb - head) / vw;
  b.vw = vw;
  b.head = (int32_t)head;
  b.body = (uint32_t)body;
  b.tail = (int32_t)(rb - head - body * vw);
  return b;
}

// Byte range [lo, hi) a view touches.
void extent(const imoe_view *v, const CallRows &pl, const Strides &st, int64_t n, int64_t row_bytes,
            uintptr_t *lo, uintptr_t *hi) {
  int64_t a = 0, b = 0;
  for (int d = 0; d < pl.lead.nd; ++d) {
    const int64_t span = (int64_t)(pl.lead.shape[d] - 1) * st.s[d];
    if (span < 0)
      a += span;
    else
      b += span;
  }
  if (n > 0) {
    const int64_t span = (n - 1) * v->n_stride;
    if (span < 0)
      a += span;
    else
      b += span;
  }
  *lo = (uintptr_t)v->data + (intptr_t)a;
  *hi = (uintptr_t)v->data + (intptr_t)b + (uintptr_t)row_bytes;
}

// ------------------------------------------------------------ workspaces
namespace {
// Row-major strides (bytes) of a [plan rows, n] int32 workspace region over
// the merged lead axes; all zero for a shared plan.
Strides ws_strides(const Lead &lead, int64_t n, bool per_row) {
  Strides s;
  memset(&s, 0, sizeof s);
  if (!per_row) return s;
  int64_t acc = n * 4;
  for (int d = lead.nd - 1; d >= 0; --d) {
    s.s[d] = acc;
    acc *= (int64_t)lead.shape[d];
  }
  return s;
}
}  // namespace

InView ws_view(const int32_t *data, const Lead &lead, int64_t n, bool per_row) {
  InView v;
  memset(&v, 0, sizeof v);
  v.data = reinterpret_cast<const char *>(data);
  v.lead = ws_strides(lead, n, per_row);
  v.n_stride = 4;
  v.dtype = IMOE_DTYPE_I32;
  v.aligned = 1;
  return v;
}

imoe_status check_workspace(const char *fn, int32_t *ws, int64_t elems, int64_t need, imoe_error *err) {
  if (need > 0 && (ws == nullptr || elems < need))
    return fail(err, IMOE_ERR_ARGUMENT,
                "%s: the CUDA path needs a device workspace of %lld int32 elements (got %lld): "
                "imoe_plan_workspace_elems gives the size",
                fn, (long long)need, (long long)(ws ? elems : 0));
  return IMOE_OK;
}

}  // namespace imoe_cu

// ------------------------------------------------------------ devices
namespace imoe_cu {
namespace {
// The virtual architectures this build was compiled for, ascending (nvcc's
// __CUDA_ARCH_LIST__: 800, 900, 1000, ...). Every build of the project
// (setup.py's IMOE_CUDA_ARCHS, nvcc -arch=sm_XY) has machine code for each of
// them and PTX for the last.
constexpr int kBuildArchs[] = {__CUDA_ARCH_LIST__};
constexpr int kNumBuildArchs = sizeof kBuildArchs / sizeof kBuildArchs[0];

// Whether a device of compute capability major.minor runs the build: machine
// code for sm_XY runs on X.Y and later minors of major X; the PTX of the last
// architecture is compiled by the driver for any later capability.
bool runs_build(int major, int minor) {
  const int cc = major * 100 + minor * 10;
  if (cc >= kBuildArchs[kNumBuildArchs - 1]) return true;
  for (int i = 0; i < kNumBuildArchs; ++i)
    if (kBuildArchs[i] / 100 == major && kBuildArchs[i] <= cc) return true;
  return false;
}

int count_runnable_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: 0, and nothing left for the next call to see
    return 0;
  }
  int runnable = 0;
  for (int dev = 0; dev < count; ++dev) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (runs_build(major, minor)) ++runnable;
  }
  return runnable;
}
}  // namespace
}  // namespace imoe_cu

extern "C" int imoe_backend_device_count(void) {
  // The visible devices are fixed when the driver initialises, so the count
  // holds for the process (and a missing driver is not looked for again).
  static std::once_flag once;
  static int count = 0;
  std::call_once(once, [] { count = imoe_cu::count_runnable_devices(); });
  return count;
}
