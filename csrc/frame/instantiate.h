// Builds one ISA's dispatch table from its kernel traits. Included last by each
// csrc/kernels/<isa>/kernels_<isa>.cpp, inside namespace pyattn::<isa>.
#pragma once

#include "frame/common.h"
#include "frame/gemm.h"
#include "frame/softmax.h"
#include "frame/attention.h"
#include "frame/merge.h"

// An attention entry: Attention<K, KV>, or, where the traits name a narrower register tile for
// short query sequences (K::Short, up to K::kShortLq queries), that one's prefill for them: a
// short sequence's panels then carry less padding through the softmax statistics.
template <class K, class KV = typename K::T, class = void>
struct AttentionEntry {
  static void run(const AttnArgs& a) { Attention<K, KV>::run(a); }
};
template <class K, class KV>
struct AttentionEntry<K, KV, std::void_t<typename K::Short>> {
  static void run(const AttnArgs& a) {
    if (a.Lq <= K::kShortLq && !Attention<K, KV>::use_decode(a)) return Attention<typename K::Short, KV>::run(a);
    Attention<K, KV>::run(a);
  }
};

template <class KF, class KD>
constexpr IsaTable make_table(const char* name) {
  return IsaTable{
      name,
      {&Gemm<KF>::run, &Gemm<KD>::run},
      {&Softmax<KF>::run, &Softmax<KD>::run},
      {&AttentionEntry<KF>::run, &AttentionEntry<KD>::run},
      {&AttentionEntry<KF, f16_t>::run, &AttentionEntry<KF, bf16_t>::run, &AttentionEntry<KF, std::int8_t>::run},
      {&Merge<typename KF::T>::run, &Merge<typename KD::T>::run}};
}
