// AArch64 Advanced SIMD (NEON) kernels: 32 vector registers of 128 bits. NEON is part of every
// AArch64 CPU, so this set needs no run-time check and is the default there. The schedules are
// the same register tiles and row kernels as the x86 sets (kernels/x86_simd.h, which names no
// intrinsic); this file supplies the vectors and the micro-kernel's k loop, which on AArch64
// multiplies by a vector lane instead of broadcasting.
#include <arm_neon.h>

#include <utility>

#include "kernels/std_includes.h"

namespace pyattn {
namespace neon {

#include "frame/common.h"

#include "kernels/neon/neon_ops.h"
#include "kernels/x86_simd.h"

// Register tiles: 8 rows of A x 3 vectors of B = 24 accumulators, with 2 A and 3 B vectors per k
// step (GEMM, P V) or 4 A and 3 B (the scores): 29 to 31 of the 32 registers.
//
// Block sizes, one table for both kernels (not measured on hardware: no AArch64 machine was at
// hand; chosen for the 64 KiB L1D and 1 MiB L2 per core of Neoverse N2 / V1, which Apple cores
// exceed):
//                      MR x NR   MC    KC    NC   NP  BK   L1 / L2 footprint
//   sgemm 8x12 neon     8 x 12   120   256   480   4  128  A micro-panel 8 KiB + B panel 12 KiB in
//                                                          L1; KC x NC packed B 480 KiB in L2
//   dgemm 8x6 neon      8 x 6    120   256   240   4  128  the same bytes in doubles
//  NP: query panels of NR per attention task (48 queries), sharing each K/V row read from L1;
//  BK: the BK x NR score tile (6 KiB) stays in L1 between the two attention GEMMs.
struct sgemm_ukernel_8x12_neon : RegTileKernels<OpsF32, 8, 3>, TransposePs {
  static constexpr int NP = 4, NPW = 4;
  static constexpr index_t MC = 120, KC = 256, NC = 480, BK = 128;
};
struct dgemm_ukernel_8x6_neon : RegTileKernels<OpsF64, 8, 3>, TransposeRef<double> {
  static constexpr int NP = 4, NPW = 4;
  static constexpr index_t MC = 120, KC = 256, NC = 240, BK = 128;
};

#include "frame/instantiate.h"

}  // namespace neon

const IsaTable isa_neon = neon::make_table<neon::sgemm_ukernel_8x12_neon, neon::dgemm_ukernel_8x6_neon>("neon");

}  // namespace pyattn
