// Allocation statistics: one shape, {current, peak, allocated, freed}, for every
// figure the allocator keeps, updated through one function (`update_stat`).
#pragma once

#include <algorithm>
#include <cstdint>

namespace wwrun::alloc {

// Invariants: current == allocated - freed (until reset_accumulated),
//             peak >= current, and peak never falls except on reset_peak.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // sum of all increases
  std::int64_t freed = 0;      // sum of all decreases
};

inline void update_stat(Stat& stat, std::int64_t delta) {
  stat.current += delta;
  if (delta > 0) {
    stat.allocated += delta;
    stat.peak = std::max(stat.peak, stat.current);
  } else {
    stat.freed -= delta;
  }
}

inline void reset_peak(Stat& stat) { stat.peak = stat.current; }

inline void reset_accumulated(Stat& stat) {
  stat.allocated = 0;
  stat.freed = 0;
}

}  // namespace wwrun::alloc
