// A kernel set's float transpose by its transpose_ps (kernels/x86_transpose.h, or
// kernels/neon/neon_ops.h): included inside the kernel set's namespace, after that definition.
#pragma once

struct TransposePs {
  template <class Scale = NoScale>
  static void transpose(const float* src, index_t srs, index_t rows, index_t cols, float* dst, index_t drs,
                        const Scale& sc = Scale{}) {
    transpose_ps(src, srs, rows, cols, dst, drs, sc);
  }
};
