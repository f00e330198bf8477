// Size classes: how a request is rounded, how many pages a new range maps for it
// and how far the range may grow, and when a free block is split. The numbers
// follow c10's CUDACachingAllocator, whose choices are tuned for the same
// workloads (many small activations, few large weights and workspaces); ranges
// that map pages on demand are its expandable segments.
#pragma once

#include <cstddef>
#include <cstdint>

namespace wwrun::alloc {

constexpr std::size_t kBlockAlignBytes = 512;             // every block starts and ends here
constexpr std::size_t kTinyRequestBytes = 256 << 10;      // <= 256 KiB: "tiny", see pool_index
constexpr std::size_t kSmallRequestBytes = 1 << 20;       // <= 1 MiB: "small"
constexpr std::size_t kSmallSegmentBytes = 2 << 20;       // small requests share 2 MiB segments
constexpr std::size_t kMediumRequestBytes = 10 << 20;     // < 10 MiB: "medium"
constexpr std::size_t kMediumSegmentBytes = 20 << 20;     // medium requests share 20 MiB segments
constexpr std::size_t kLargeSegmentRoundBytes = 2 << 20;  // large segments: multiples of 2 MiB

inline std::size_t round_size(std::size_t bytes) {
  if (bytes == 0) return kBlockAlignBytes;
  return (bytes + kBlockAlignBytes - 1) / kBlockAlignBytes * kBlockAlignBytes;
}

// The pages a new range maps for a request: its size in whole pages.
inline std::size_t range_bytes(std::size_t rounded) {
  return (rounded + kLargeSegmentRoundBytes - 1) / kLargeSegmentRoundBytes *
         kLargeSegmentRoundBytes;
}

// The virtual room a new range keeps for the requests of its class: c10's
// segment sizes. A range maps only the pages its requests need (range_bytes)
// and grows into this room as they come; at 32 MiB, a 20 MiB segment made at
// once for one 3 MiB request was 62% of the budget.
inline std::size_t range_room(std::size_t rounded) {
  if (rounded <= kSmallRequestBytes) return kSmallSegmentBytes;
  if (rounded < kMediumRequestBytes) return kMediumSegmentBytes;
  return range_bytes(rounded);
}

// The pool a request is served from, and its segments' kind. Tiny requests
// (biases, scalars, indices, small layers' weights and gradients) share 2 MiB
// segments of their own, as small ones do in c10, but apart from requests of up to
// 1 MiB: mixed in one segment, a long-lived tiny block splits the hole a
// half-segment activation needs, and a pool of 2 MiB segments ends up with one
// such activation per segment (jemalloc and tcmalloc segregate sizes for the same
// reason).
enum PoolIndex : std::uint8_t { kTinyPool = 0, kSmallPool = 1, kLargePool = 2, kPoolCount = 3 };

inline PoolIndex pool_index(std::size_t rounded) {
  if (rounded <= kTinyRequestBytes) return kTinyPool;
  return rounded <= kSmallRequestBytes ? kSmallPool : kLargePool;
}

// A block larger than the request is split when the remainder is worth keeping:
// any remainder for small requests, more than a small request for large ones
// (so large blocks are not shredded into slivers; c10 does the same), and any
// remainder at a range's end, which the range grows from (rule d): a request a
// little over 1 MiB in a range of one page would otherwise hold the whole page.
inline bool should_split(std::size_t block, std::size_t rounded, bool ends_range) {
  std::size_t remainder = block - rounded;
  return rounded <= kSmallRequestBytes || ends_range ? remainder >= kBlockAlignBytes
                                                     : remainder > kSmallRequestBytes;
}

}  // namespace wwrun::alloc
