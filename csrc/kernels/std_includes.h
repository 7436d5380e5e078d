// Standard and OpenMP headers every kernel translation unit needs, included *before* the
// per-ISA namespace opens (the frame headers are included inside it).
#pragma once
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "frame/api.h"
#include "frame/portable.h"
