"""The low-precision Adam step on the CPU as one C++ loop (torch.utils.cpp_extension, built at first use
and cached by torch in ~/.cache/torch_extensions).

Same formulas and number formats as adam_lowp.py / lowbit.py (state written by one reads in the
other), walked once per block of ``BLOCK`` elements: parameter, gradient and moments are read once,
the block's new moments wait in a stack buffer until its scale is known, then are coded. OpenMP
spreads the blocks over the optimizer thread's cores. torch.compile's C++ for the same function ran
4-8x slower than torch's fused fp32 AdamW (bench/optim_lowp.py), recomputing the update around the
per-block maximum; this loop is the issue's "compiled or C++ CPU kernel".
"""
from __future__ import annotations

import hashlib
import logging
import platform
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {
constexpr int64_t B = 64;  // lowbit.BLOCK

inline uint32_t mix(uint32_t x) {  // lowbit.hash32, in 32-bit unsigned arithmetic
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}
inline float from_bf16(uint16_t b) { uint32_t u = uint32_t(b) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t to_bf16_stochastic(float f, uint32_t noise) {
  uint32_t u; std::memcpy(&u, &f, 4);
  return uint16_t((u + (noise & 0xFFFFu)) >> 16);
}
template <typename T> inline float load(const T* a, int64_t i);
template <> inline float load<float>(const float* a, int64_t i) { return a[i]; }
template <> inline float load<uint16_t>(const uint16_t* a, int64_t i) { return from_bf16(a[i]); }

// STATE: 0 fp32 moments, 1 bf16 moments (stochastic rounding), 2 8-bit moments with a scale per block.
// Each loop is simple and its pointers restrict-qualified, so gcc vectorizes it.
// Blocks [b0, b1) of one run. A plain function of values, not the body of a lambda capturing by reference:
// there the int8 stores (char may alias anything) made gcc reload every captured scalar and give up
// vectorizing, 6x slower (11 against 1.9 ns a parameter on one core of this CI machine).
template <typename P, typename G, int STATE, bool DECOUPLED, bool FULL>
void run_blocks(P* __restrict__ p, const G* __restrict__ g, void* m_, void* v_, float* __restrict__ ms, float* __restrict__ vs,
                const float lr, const float beta1, const float beta2, const float eps, const float wd, const float c1,
                const float c2, const float inv, const int64_t n, const uint32_t seed, const int64_t start, const int64_t b0, const int64_t b1) {
  const float step_size = lr / c1, decay = 1.f - lr * wd, one_b1 = 1.f - beta1, one_b2 = 1.f - beta2;
  const uint32_t m_seed = seed ^ 0x5BD1E995u, v_seed = seed ^ 0x27D4EB2Fu;
#if defined(__SSE__)
  // Flush denormals to zero while stepping: a second moment of tiny gradients (1e-20) otherwise takes the
  // slow microcoded path, 2.4x slower; the values flushed are below 1.2e-38, far under any update's size.
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);
#endif
  {
    alignas(64) float mt[B], vt[B], mo[B], vo[B], so[B];
    for (int64_t blk = b0; blk < b1; ++blk) {
      // FULL: every block of the run whole, so each loop's length is the constant B (unrolled, no remainder code):
      // 0.93 -> 0.88 ns a parameter on one core of the CI machine (bench/README, twenty-first session)
      const int64_t lo = blk * B, len = FULL ? B : std::min(B, n - lo);
      P* __restrict__ pb = p + lo;
      const G* __restrict__ gb = g + lo;
      if (STATE == 0) {
        std::memcpy(mt, (float*)m_ + lo, len * 4); std::memcpy(vt, (float*)v_ + lo, len * 4);
      } else if (STATE == 1) {
        const uint16_t* __restrict__ mb = (uint16_t*)m_ + lo; const uint16_t* __restrict__ vb = (uint16_t*)v_ + lo;
        for (int64_t j = 0; j < len; ++j) { mt[j] = from_bf16(mb[j]); vt[j] = from_bf16(vb[j]); }
      } else {
        const int8_t* __restrict__ mb = (int8_t*)m_ + lo; const uint8_t* __restrict__ vb = (uint8_t*)v_ + lo;
        const float dm = ms[blk] / (127.f * 127.f), dv = vs[blk];
        for (int64_t j = 0; j < len; ++j) {
          float qm = float(mb[j]); mt[j] = qm * std::fabs(qm) * dm;
          float qv = float(vb[j]) * (1.f / 255.f); qv = qv * qv; vt[j] = qv * qv * dv;
        }
      }
      for (int64_t j = 0; j < len; ++j) {
        float gi = load(gb, j) * inv, pi = load(pb, j);
        if (DECOUPLED) pi = pi * decay; else gi = gi + wd * pi;
        float mi = mt[j] + (gi - mt[j]) * one_b1;
        float vi = vt[j] * beta2 + gi * gi * one_b2;
        const float si = std::sqrt(vi);
        pi = pi - step_size * mi / (si / c2 + eps);
        mo[j] = mi; vo[j] = vi; so[j] = si;
        if constexpr (std::is_same<P, float>::value) pb[j] = pi;
        else pb[j] = to_bf16_stochastic(pi, mix(uint32_t(start + lo + j) ^ seed));
      }
      if (STATE == 0) {
        std::memcpy((float*)m_ + lo, mo, len * 4); std::memcpy((float*)v_ + lo, vo, len * 4);
      } else if (STATE == 1) {
        uint16_t* __restrict__ mb = (uint16_t*)m_ + lo; uint16_t* __restrict__ vb = (uint16_t*)v_ + lo;
        for (int64_t j = 0; j < len; ++j) {
          const uint32_t idx = uint32_t(start + lo + j);
          mb[j] = to_bf16_stochastic(mo[j], mix(idx ^ m_seed)); vb[j] = to_bf16_stochastic(vo[j], mix(idx ^ v_seed));
        }
      } else {
        float m_scale = 0.f, v_scale = 0.f;
        for (int64_t j = 0; j < len; ++j) { m_scale = std::max(m_scale, std::fabs(mo[j])); v_scale = std::max(v_scale, vo[j]); }
        const float tiny = 1.17549435e-38f;
        const float m_inv = 1.f / std::max(m_scale, tiny), v_inv = 1.f / std::max(v_scale, tiny);
        // The fourth root of v / scale is the square root of sqrt(v) / sqrt(scale): sqrt(v) is the update's
        // denominator's, so the code costs one square root instead of two (0.88-0.91 -> 0.82 ns/param on CI's
        // 2 cores, separate invocations; approximate square roots, -mrecip, gained nothing more). Its rounding may
        // differ from lowbit.py's sqrt(sqrt(a)) by an fp32 step, moving a code across a boundary now and then.
        const float v_inv_sqrt = std::sqrt(v_inv);
        int8_t* __restrict__ mq = (int8_t*)m_ + lo; uint8_t* __restrict__ vq = (uint8_t*)v_ + lo;
        // lowbit._code: stochastic rounding in value space. Constant divisors are multiplications by their
        // reciprocal, as in lowbit.py: a vector division costs several multiplications' time.
        for (int64_t j = 0; j < len; ++j) {
          const uint32_t idx = uint32_t(start + lo + j);
          const uint32_t bits = mix(idx ^ m_seed);  // lowbit.moment_uniforms: one hash, 16 bits for each moment's code
          const float am = std::fabs(mo[j]) * m_inv, um = float(bits & 0xFFFFu) * (1.f / 65536.f);
          const float cm = std::min(std::floor(std::sqrt(am) * 127.f), 126.f);
          const float tm = cm * (1.f / 127.f), tm1 = (cm + 1.f) * (1.f / 127.f), bm = tm * tm, abm = tm1 * tm1;
          const float a = cm + (am - bm > um * (abm - bm) ? 1.f : 0.f);
          mq[j] = int8_t(mo[j] < 0.f ? -a : a);
          const float av = vo[j] * v_inv, uv = float(bits >> 16) * (1.f / 65536.f);
          const float cv = std::min(std::floor(std::sqrt(so[j] * v_inv_sqrt) * 255.f), 254.f);
          float tv = cv * (1.f / 255.f), tv1 = (cv + 1.f) * (1.f / 255.f);
          tv = tv * tv; tv1 = tv1 * tv1;
          const float bv = tv * tv, abv = tv1 * tv1;
          const float l = cv + (av - bv > uv * (abv - bv) ? 1.f : 0.f);
          vq[j] = uint8_t(vo[j] > 0.f ? std::max(l, 1.f) : 0.f);
        }
        for (int64_t j = len; j < B; ++j) { mq[j] = 0; vq[j] = 0; }
        ms[blk] = m_scale; vs[blk] = v_scale;
      }
    }
  }
#if defined(__SSE__)
  _mm_setcsr(csr);
#endif
}

template <typename P, typename G, int STATE, bool DECOUPLED>
void run(P* p, const G* g, void* m_, void* v_, float* ms, float* vs, const float* h, int64_t n, uint32_t seed, int64_t start) {
  const int64_t whole = n / B, blocks = (n + B - 1) / B;
  const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4], c1 = h[5], c2 = h[6], inv = h[7];
  at::parallel_for(0, whole, 16, [=](int64_t b0, int64_t b1) {
    run_blocks<P, G, STATE, DECOUPLED, true>(p, g, m_, v_, ms, vs, lr, beta1, beta2, eps, wd, c1, c2, inv, n, seed, start, b0, b1);
  });
  if (blocks > whole)  // the run's last, partial block
    run_blocks<P, G, STATE, DECOUPLED, false>(p, g, m_, v_, ms, vs, lr, beta1, beta2, eps, wd, c1, c2, inv, n, seed, start, whole, blocks);
}

template <typename P, typename G>
void dispatch_state(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor ms, torch::Tensor vs,
                    const float* h, uint32_t seed, int64_t start, bool decoupled) {
  P* pp = (P*)p.data_ptr(); const G* gp = (const G*)g.data_ptr();
  float* msp = ms.numel() ? ms.data_ptr<float>() : nullptr; float* vsp = vs.numel() ? vs.data_ptr<float>() : nullptr;
  int64_t n = p.numel();
  void* mp = m.data_ptr(); void* vp = v.data_ptr();
  const int kind = m.scalar_type() == torch::kFloat ? 0 : m.scalar_type() == torch::kBFloat16 ? 1 : 2;
  if (kind == 0) { if (decoupled) run<P, G, 0, true>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); else run<P, G, 0, false>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); }
  else if (kind == 1) { if (decoupled) run<P, G, 1, true>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); else run<P, G, 1, false>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); }
  else { if (decoupled) run<P, G, 2, true>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); else run<P, G, 2, false>(pp, gp, mp, vp, msp, vsp, h, n, seed, start); }
}
}  // namespace

void adam_step(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor ms, torch::Tensor vs,
               torch::Tensor h, int64_t seed, int64_t start, bool decoupled) {
  TORCH_CHECK(p.is_contiguous() && g.is_contiguous() && m.is_contiguous() && v.is_contiguous(), "contiguous flat runs only");
  TORCH_CHECK(h.scalar_type() == torch::kFloat && h.numel() == 8, "h: 8 fp32 hyper-parameters");
  const float* hp = h.data_ptr<float>();
  const uint32_t s = uint32_t(seed & 0xFFFFFFFF);
  const bool pb = p.scalar_type() == torch::kBFloat16, gb = g.scalar_type() == torch::kBFloat16;
  if (pb && gb) dispatch_state<uint16_t, uint16_t>(p, g, m, v, ms, vs, hp, s, start, decoupled);
  else if (pb) dispatch_state<uint16_t, float>(p, g, m, v, ms, vs, hp, s, start, decoupled);
  else if (gb) dispatch_state<float, uint16_t>(p, g, m, v, ms, vs, hp, s, start, decoupled);
  else dispatch_state<float, float>(p, g, m, v, ms, vs, hp, s, start, decoupled);
}

// The GIL is released while the loop runs (seconds for a large host share): the thread issuing the next call
// goes on meanwhile, and so does a GPU-assisted step's issuing of its chunks (optim/assist.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>()); }
"""

_module: Any = None
_failed = False
# -mprefer-vector-width=512: gcc builds for Intel's AVX-512 Xeons with 256-bit vectors unless told otherwise
# (`-march=native` is sapphirerapids on the GPU machine, preferring 256). The loop is bound by its arithmetic, so the
# width decides its speed: 0.261 against 0.337 ns a parameter at 16 threads there (fused fp32 AdamW 0.247; H100 machine,
# one invocation, 2026-12-07, bench/README). On CPUs without AVX-512 it changes nothing; on the CI machines' AMD EPYCs it
# changed nothing measurable (one already built 512 wide, 0.447; with 256 forced it took 0.777).
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
          "-fno-signed-zeros", "-ffinite-math-only"]
# Set before the first kernel() call to build a candidate (bench/optim_lowp.py --cflags). Tried and dropped:
# "-funsafe-math-optimizations -mrecip=all" (the square roots and the division as refined approximate reciprocals):
# slower on both hosts measured, the CI machine's AMD EPYC (1.008 against 0.854 ns a parameter on one core) and the
# GPU machine's Xeon (0.357 against 0.301 at 16 threads, 2026-12-07, bench/README).
extra_cflags: list[str] = []


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction-set flags. The module is built with -march=native
    and torch caches builds by name in the user's home, which a cluster's nodes may share: a build from
    another CPU model could stop this one with an illegal instruction, so each CPU kind gets its own name."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("flags", "model name", "Features", "CPU part"))]
        text = "\n".join(dict.fromkeys(lines)) or platform.processor()
    except OSError:
        text = platform.machine() + platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def kernel() -> Optional[Any]:
    """The built extension, or None where it cannot be built (no compiler): callers fall back."""
    global _module, _failed
    if _module is None and not _failed:
        try:
            from torch.utils.cpp_extension import load_inline
            # -fopenmp: at::parallel_for is a header-inline `#pragma omp parallel`; without the flag the loop ran
            # on one thread (3.67 ns a parameter on the GPU machine's 16 cores, 18.6x torch's fused fp32 AdamW).
            flags = [*CFLAGS, *extra_cflags]
            tag = _cpu_tag() + (hashlib.sha256(" ".join(extra_cflags).encode()).hexdigest()[:6] if extra_cflags else "")
            _module = load_inline(f"rptrain_adam_lowp_v14_{tag}", cpp_sources=[_SOURCE], extra_cflags=flags,
                                  extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as error:  # noqa: BLE001 - any build failure means: use the torch formulas
            _failed = True
            log.warning("building the C++ low-precision Adam step failed (%s); the eager torch formulas run instead", error)
    return _module


def step(p: Tensor, g: Tensor, state: dict[str, Tensor], h: Tensor, seed: int, decoupled: bool, start: int = 0) -> bool:
    """One step of a flat run with the C++ loop; False where it is not available. ``start``: the
    element of the whole run ``p`` begins at (a multiple of the block): its random bits are that element's."""
    module = kernel()
    if module is None:
        return False
    empty = torch.empty(0)
    module.adam_step(p, g, state["exp_avg"], state["exp_avg_sq"], state.get("exp_avg_scale", empty),
                     state.get("exp_avg_sq_scale", empty), h, seed, start, decoupled)
    return True
