"""Bytes held by PyTorch's CPU allocator, current and peak: ``torch.cuda.memory_allocated``
for the CPU, so every peer's memory is measured the same way.

[Note: one meter for every peer's CPU memory]
The peers keep their memory in different places: DDP's gradient buckets live in
C++, DeepSpeed keeps flat partitions, FSDP2 sharded DTensors, Inductor's
generated code allocates its buffers without going through Python dispatch, and
zero_fx's compiled graph does the same. A tensor census (``gc``, a dispatch mode
such as MemTracker or ``LiveTensorBytes``) misses some of each; resident-set
peaks count the compiler's own heap too, which only compiled peers have. What
all of them share is c10's CPU allocator: every CPU tensor's storage comes from
``c10::GetCPUAllocator()``. So we put a counting allocator in front of the
default one (``c10::SetCPUAllocator`` with a higher priority), built once as a
small C++ extension: it adds each allocation's size to a running total, keeps
the high-water mark, and subtracts on free. Installed before the model is
built, it sees everything the step keeps and everything it allocates on the
way; what it cannot see is memory outside tensors (gloo's own send buffers,
the Python heap), which is the same kind of thing for every peer.
"""

from __future__ import annotations

import os

_SOURCE = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::mutex g_mutex;
std::unordered_map<void*, size_t> g_sizes;
c10::Allocator* g_base = nullptr;

void count_free(void* ptr) {
  size_t n = 0;
  {
    std::lock_guard<std::mutex> guard(g_mutex);
    auto it = g_sizes.find(ptr);
    if (it != g_sizes.end()) { n = it->second; g_sizes.erase(it); }
  }
  g_current -= static_cast<int64_t>(n);
  g_base->raw_deleter()(ptr);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = g_base->allocate(n);
    void* ptr = inner.release_context();
    if (ptr == nullptr) return c10::DataPtr(nullptr, nullptr, &count_free, c10::Device(c10::kCPU));
    {
      std::lock_guard<std::mutex> guard(g_mutex);
      g_sizes[ptr] = n;
    }
    int64_t now = g_current += static_cast<int64_t>(n);
    int64_t peak = g_peak.load();
    while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {}
    return c10::DataPtr(ptr, ptr, &count_free, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &count_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator g_counting;

}  // namespace

void install() {
  if (g_base != nullptr) return;
  g_base = c10::GetDefaultCPUAllocator();
  c10::SetCPUAllocator(&g_counting, /*priority=*/100);
}
int64_t current() { return g_current.load(); }
int64_t peak() { return g_peak.load(); }
void reset_peak() { g_peak.store(g_current.load()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("current", &current);
  m.def("peak", &peak);
  m.def("reset_peak", &reset_peak);
}
"""

_module = None


def build():
    """The extension, compiled on first use (~20 s, cached under ``$TORCH_EXTENSIONS_DIR``)."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load_inline

        _module = load_inline("zero_fx_bench_cpu_memory", cpp_sources=_SOURCE,
                              verbose=os.environ.get("BENCH_VERBOSE_BUILD") == "1")
    return _module


def install() -> None:
    """Count every CPU allocation from now on. Call before the model is built."""
    build().install()


def allocated() -> int:
    """Bytes of CPU tensor storage allocated since ``install`` and not yet freed."""
    return _module.current()


def max_allocated() -> int:
    """Highest ``allocated()`` since the last ``reset_peak``."""
    return _module.peak()


def reset_peak() -> None:
    _module.reset_peak()
