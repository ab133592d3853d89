// A CPU allocator that keeps large freed buffers for the next allocation of about the same size
// (layers/cpu_buffers.py). Each fresh large buffer costs a page fault per 4 KB page the first time it is written
// (the kernel zeroes the page): a prefill's activations of tens to hundreds of MB, allocated and freed in every
// layer, spent about as long faulting as computing their elementwise passes. Blocks below `min_bytes` go to torch's
// allocator as before (the heap reuses those itself); larger ones are reused best-fit (a freed block serves a request
// of at least half its size), the least recently freed handed back to the system once more than `cap_bytes` are
// kept. Installed with torch's CPU allocator priority above the default; tensors allocated before keep their own
// deleter.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace buffer_cache {

struct State {
  std::mutex mu;
  std::atomic<size_t> min_bytes{8u << 20};  // read without the lock by every allocation
  size_t cap_bytes = 0;
  size_t cached_bytes = 0;
  int64_t reused = 0;
  int64_t fresh = 0;
  std::unordered_map<void*, size_t> sizes;    // every block this allocator made that is not freed yet
  std::vector<std::pair<void*, size_t>> free;  // kept blocks, the least recently freed first
};

// Never destroyed: tensors may be freed during the interpreter's shutdown, after static destructors ran.
inline State& state() {
  static State* s = new State();
  return *s;
}

// Hands kept blocks back (the least recently freed first) until at most `keep` bytes are kept; the lock is held.
inline void trim_locked(State& s, size_t keep) {
  size_t drop = 0;
  while (drop < s.free.size() && s.cached_bytes > keep) {
    s.cached_bytes -= s.free[drop].second;
    s.sizes.erase(s.free[drop].first);
    c10::free_cpu(s.free[drop].first);
    ++drop;
  }
  s.free.erase(s.free.begin(), s.free.begin() + static_cast<std::ptrdiff_t>(drop));
}

// The allocator in place before this one (torch's default CPU allocator), which makes the small blocks.
inline c10::Allocator*& base() {
  static c10::Allocator* b = nullptr;
  return b;
}

// Every block's deleter, also raw_deallocate's: a small block (made by the allocator before) goes back to it.
inline void release(void* p) {
  State& s = state();
  std::unique_lock<std::mutex> lock(s.mu);
  auto it = s.sizes.find(p);
  if (it == s.sizes.end()) {
    lock.unlock();
    c10::DeleterFnPtr d = base()->raw_deleter();
    if (d != nullptr) {
      d(p);
    } else {
      c10::free_cpu(p);
    }
    return;
  }
  if (it->second > s.cap_bytes) {
    s.sizes.erase(it);
    c10::free_cpu(p);
    return;
  }
  s.free.emplace_back(p, it->second);
  s.cached_bytes += it->second;
  trim_locked(s, s.cap_bytes);
}

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    State& s = state();
    const c10::Device cpu(c10::DeviceType::CPU);
    if (n < s.min_bytes.load(std::memory_order_relaxed)) return base()->allocate(n);
    {
      std::lock_guard<std::mutex> lock(s.mu);
      size_t best = s.free.size();
      for (size_t i = 0; i < s.free.size(); ++i) {
        const size_t size = s.free[i].second;
        if (size >= n && size / 2 <= n && (best == s.free.size() || size < s.free[best].second)) best = i;
      }
      if (best < s.free.size()) {
        void* p = s.free[best].first;
        s.cached_bytes -= s.free[best].second;
        s.free.erase(s.free.begin() + static_cast<std::ptrdiff_t>(best));
        ++s.reused;
        return {p, p, &release, cpu};
      }
    }
    void* p = c10::alloc_cpu(n);
    std::lock_guard<std::mutex> lock(s.mu);
    s.sizes.emplace(p, n);
    ++s.fresh;
    return {p, p, &release, cpu};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

// Sets how many freed bytes are kept at most and from which size a block is kept, and installs the allocator (once
// per process) the first time the cap is above 0; cap 0 keeps none (the blocks kept are handed back at once, and
// every large block when it is freed).
inline void configure(int64_t cap_bytes, int64_t min_bytes) {
  TORCH_CHECK(cap_bytes >= 0 && min_bytes > 0, "cap_bytes must be >= 0 and min_bytes > 0");
  static CachingAllocator* installed = nullptr;
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.cap_bytes = static_cast<size_t>(cap_bytes);
    s.min_bytes.store(static_cast<size_t>(min_bytes), std::memory_order_relaxed);
    trim_locked(s, s.cap_bytes);
  }
  if (installed == nullptr && cap_bytes > 0) {
#if defined(__GLIBC__)
    // glibc raises its mmap threshold (up to 32 MB) only when it frees a block it mapped; with the large blocks kept
    // here it would stay low and map (and fault in) every mid-sized block afresh. Fixed: below min_bytes from the
    // heap, whose top is handed back only beyond 8x that.
    mallopt(M_MMAP_THRESHOLD, static_cast<int>(min_bytes));
    mallopt(M_TRIM_THRESHOLD, static_cast<int>(8 * min_bytes));
#endif
    installed = new CachingAllocator();
    base() = c10::GetCPUAllocator();
    c10::SetCPUAllocator(installed, /*priority=*/1);
  }
}

// (bytes kept, blocks kept, allocations served from kept blocks, large allocations made fresh, cap)
inline std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t> stats() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return {static_cast<int64_t>(s.cached_bytes), static_cast<int64_t>(s.free.size()), s.reused, s.fresh,
          static_cast<int64_t>(s.cap_bytes)};
}

}  // namespace buffer_cache
