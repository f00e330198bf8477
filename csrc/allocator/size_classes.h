// Size classes: how a request is rounded, how big a new segment is, and when a
// free block is split. The numbers follow c10's CUDACachingAllocator, whose
// choices are tuned for the same workloads (many small activations, few large
// weights and workspaces).
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

inline std::size_t segment_size(std::size_t rounded) {
  if (rounded <= kSmallRequestBytes) return kSmallSegmentBytes;
  if (rounded < kMediumRequestBytes) return kMediumSegmentBytes;
  return (rounded + kLargeSegmentRoundBytes - 1) / kLargeSegmentRoundBytes *
         kLargeSegmentRoundBytes;
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

// The smallest segment for a request, tried when the usual one does not fit
// under the device's limit or in its free memory.
inline std::size_t tight_segment_size(std::size_t rounded) {
  if (rounded <= kSmallRequestBytes) return kSmallSegmentBytes;
  return (rounded + kLargeSegmentRoundBytes - 1) / kLargeSegmentRoundBytes *
         kLargeSegmentRoundBytes;
}

// A block larger than the request is split when the remainder is worth keeping:
// any remainder for small requests, more than a small request for large ones
// (so large blocks are not shredded into slivers; c10 does the same).
inline bool should_split(std::size_t block, std::size_t rounded) {
  std::size_t remainder = block - rounded;
  return rounded <= kSmallRequestBytes ? remainder >= kBlockAlignBytes
                                       : remainder > kSmallRequestBytes;
}

}  // namespace wwrun::alloc
