// Size classes: how a request is rounded, how much virtual memory a new range
// keeps for its class, and when a free block is split. The numbers
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
constexpr std::size_t kMediumRequestBytes = 10 << 20;     // < 10 MiB: "medium"
constexpr std::size_t kMediumSegmentBytes = 20 << 20;     // the room of every range below it

inline std::size_t round_size(std::size_t bytes) {
  if (bytes == 0) return kBlockAlignBytes;
  return (bytes + kBlockAlignBytes - 1) / kBlockAlignBytes * kBlockAlignBytes;
}

// A request's bytes in whole pages of `page` bytes.
inline std::size_t range_bytes(std::size_t rounded, std::size_t page) {
  return (rounded + page - 1) / page * page;
}

// The virtual memory a new range keeps for the requests of its class: c10's
// largest segment size, for every class below it. Pages are mapped only under
// the blocks handed out (Note [Layouts] in waterwave_allocator.h), so the room
// costs address space alone, and a job's requests of a class run on in one
// range: a range's partly used last page is per range, and ranges of 4 MiB once
// held a small job's 0.5 MiB activations in two (a page of 24 spent on the tails).
inline std::size_t range_room(std::size_t rounded, std::size_t page) {
  if (rounded < kMediumRequestBytes) return kMediumSegmentBytes;
  return range_bytes(rounded, page);
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
// remainder at a range's end, where the next requests of the range go: a request
// a little over 1 MiB in a range of one page would otherwise hold the whole page.
inline bool should_split(std::size_t block, std::size_t rounded, bool ends_range) {
  std::size_t remainder = block - rounded;
  return rounded <= kSmallRequestBytes || ends_range ? remainder >= kBlockAlignBytes
                                                     : remainder > kSmallRequestBytes;
}

}  // namespace wwrun::alloc
