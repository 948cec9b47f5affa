// Sizes and strides of one vegas::paged_block_scores call (raw-pointer kernel, no torch).
#pragma once

#include <cstdint>
#include <limits>

namespace vegas {
namespace cpu {

struct PagedDims {
  int64_t R, Hq, Hkv, G, D, page_size, max_pages;
  int64_t qs_t, qs_h, qs_d;           // q strides (token, head, dim), in elements
  int64_t ks_p, ks_h, ks_t, ks_d;     // key_cache strides (page, head, slot, dim), in elements
};

inline int64_t paged_ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
constexpr float kPagedNegInf = -std::numeric_limits<float>::infinity();

}  // namespace cpu
}  // namespace vegas
