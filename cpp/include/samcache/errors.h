// Exceptions thrown by the native core. The bindings map each to a Python exception class
// (samcache.OutOfBlocks, samcache.CacheFull, KeyError, ValueError, ...), so no bad input ever
// aborts the process.
#pragma once

#include <stdexcept>
#include <string>

namespace samcache {

// The pool has no free block left after evicting every unreferenced cached block.
struct OutOfBlocks : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The content index cannot make room: the entry is larger than what unpinned entries free.
struct CacheFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// An unknown or already-freed sequence id, or a key that is not in the index.
struct NotFound : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// check_invariants() found internal state that contradicts itself (a bug, never bad input).
struct InvariantViolation : std::logic_error {
  using std::logic_error::logic_error;
};
// Bad arguments: std::invalid_argument (→ ValueError).

}  // namespace samcache
