// Builds one ISA's dispatch table from its kernel traits. Included last by each
// csrc/kernels/<isa>/kernels_<isa>.cpp, inside namespace pyattn::<isa>.
#pragma once

#include "frame/common.h"
#include "frame/gemm.h"
#include "frame/softmax.h"
#include "frame/attention.h"
#include "frame/merge.h"

template <class KF, class KD>
constexpr IsaTable make_table(const char* name) {
  return IsaTable{name,
                  {&Gemm<KF>::run, &Gemm<KD>::run},
                  {&Softmax<KF>::run, &Softmax<KD>::run},
                  {&Attention<KF>::run, &Attention<KD>::run},
                  {&Attention<KF, f16_t>::run, &Attention<KF, bf16_t>::run, &Attention<KF, std::int8_t>::run},
                  {&Merge<typename KF::T>::run, &Merge<typename KD::T>::run}};
}
