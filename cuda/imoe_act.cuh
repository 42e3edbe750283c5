// imoe_act.cuh: the gated activation's act(x) in F32 on the device, as the
// CPU core computes it (csrc/moe_combine.c, imoe_activate): k_gated_act
// (imoe_moe.cu) and the experts GEMM's gated epilogue
// (imoe_experts_gemm.cu).
#pragma once

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

}  // namespace imoe_cu
