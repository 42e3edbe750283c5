// imoe_act.cuh: the gated activation's act(x) in F32 on the device, as the
// CPU core computes it (csrc/moe_combine.c, imoe_activate), and its value
// before the output's rounding (imoe_gated): k_gated_act (imoe_moe.cu), the
// experts GEMM's gated epilogue (imoe_experts_gemm.cu) and the fused layer's
// activation backward (imoe_moe_backward.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "idempotent_moe.h"

namespace imoe_cu {

__device__ __forceinline__ float activate(float x, int act) {
  switch (act) {
    case IMOE_ACT_SILU: return x / (1.0f + expf(-x));
    case IMOE_ACT_GELU: {
      constexpr float kAlpha = (float)M_SQRT1_2;
      return 0.5f * x * (1.0f + erff(x * kAlpha));
    }
    case IMOE_ACT_GELU_TANH: {
      constexpr float kBeta = (float)(M_SQRT2 * M_2_SQRTPI * 0.5);
      constexpr float kKappa = 0.044715f;
      const float cube = x * x * x;
      const float inner = kBeta * (x + kKappa * cube);
      return 0.5f * x * (1.0f + tanhf(inner));
    }
    default: return isnan(x) ? x : fmaxf(x, 0.0f);
  }
}

// v rounded to dtype dt (F32: v).
__device__ __forceinline__ float round_to(float v, int dt) {
  if (dt == IMOE_DTYPE_F16) return __half2float(__float2half_rn(v));
  if (dt == IMOE_DTYPE_BF16) return __bfloat162float(__float2bfloat16_rn(v));
  return v;
}

// The gated activation's value before its one rounding into dt: act(gate)
// rounded to dt, times up (the CPU core's imoe_gated). k_gated_act writes
// it; the fused layer's backward recomputes it, bit for bit.
__device__ __forceinline__ float gated(float gate, float up, int act, int dt) {
  return __fmul_rn(round_to(activate(gate, act), dt), up);
}

}  // namespace imoe_cu
