// attnrt::Runtime: the entry point. It validates every input once, owns devices, backends,
// workspaces and the plan cache, and applies the selection and fallback policy of design.md §4:
//
//   * candidates per (op, device) in priority order; `disable` removes backends; `force_backend`
//     pins one and fails closed (BackendUnavailable with the reason, no fallback);
//   * automatic mode: a probe that says Unavailable skips the candidate; a BackendUnavailable
//     from plan or run marks that backend unavailable for (op, device) for the Runtime's life,
//     logs one warning, and the same call completes on the next candidate;
//   * strict mode: any fallback is an error;
//   * bad input raises InvalidArgument before any backend runs, and never triggers fallback.
//
// Typical use: plan once per batch layout, run once per layer.
//
//   attnrt::Runtime rt;
//   auto plan = rt.plan(problem, layout);        // validates, selects, plans
//   for (int l = 0; l < layers; ++l) rt.run(*plan, tensors_of_layer(l));
//
// A Runtime is thread-safe: plan and run may be called from many threads at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/problem.h"
#include "attnrt/types.h"

namespace attnrt {

struct RuntimeOptions {
  // Unset fields take their value from the environment variable named beside them.
  std::optional<std::string> plugin_path;           // ATTNRT_PLUGIN_PATH (colon-separated)
  std::optional<std::vector<std::string>> disable;  // ATTNRT_DISABLE (comma-separated)
  std::optional<std::string> force_backend;         // ATTNRT_BACKEND
  std::optional<bool> strict;                       // ATTNRT_STRICT=1
  std::optional<bool> force_replan;                 // ATTNRT_FORCE_REPLAN=1
  std::optional<int> num_threads;                   // ATTNRT_NUM_THREADS; default: all cores
  // cpu backend kernels: "avx512", "avx2" or "baseline" (ATTNRT_CPU_ISA); default: the best
  // this CPU supports. Naming one the CPU lacks is an InvalidArgument.
  std::optional<std::string> cpu_isa;
  // Also search the directory that holds the attnrt library for plugins.
  bool search_library_dir = true;
  // Run every plugin's canary before its first use on a device (design.md §4).
  bool canary = true;
  size_t plan_cache_capacity = 256;
};

class Runtime;

// A validated, planned op: one problem on one batch layout, with the backend that serves it.
// Immutable to the caller; shared between every layer that runs it.
class Plan {
 public:
  ~Plan();
  const Problem& problem() const;
  // A copy: update() may change a shared plan's layout while another thread reads it.
  BatchLayout layout() const;
  // Name of the backend that currently serves this plan (changes only on fallback).
  std::string backend() const;

 private:
  friend class Runtime;
  struct State;
  explicit Plan(std::unique_ptr<State> s);
  std::unique_ptr<State> state_;
};

// Device memory owned by a Runtime. Host memory for Device::cpu().
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&&) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&&) noexcept;
  ~DeviceBuffer();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const Device& device() const { return device_; }

 private:
  friend class Runtime;
  void* data_ = nullptr;
  size_t size_ = 0;
  Device device_{};
  std::shared_ptr<void> owner_;  // keeps the allocator alive; frees on last release
};

struct BackendState {
  std::string backend;
  bool available = false;
  std::string reason;  // why not, when unavailable
};

struct OpDeviceReport {
  Op op{};
  Device device{};
  std::string chosen;                 // empty when nothing served yet
  std::vector<BackendState> skipped;  // candidates tried before `chosen`, with reasons
  int64_t calls = 0;                  // runs completed
  int64_t fallbacks = 0;              // times a backend failed here and another took over
  // Runs of `chosen` that went a slower way than their plan chose (results still correct; e.g.
  // a GPU kernel that could not get the multiprocessors it planned for), and what that way is;
  // -1 when the backend could not say (the note says why).
  int64_t degraded_runs = 0;
  std::string degraded_note;
};

struct PluginLoadRecord {
  std::string path;
  std::string name;  // empty if it never got that far
  bool loaded = false;
  std::string reason;  // why not
  // Not loaded for a reason that is normal on some machines, not a defect of the plugin: its
  // init() reported its runtime, driver or hardware absent (ATTNRT_UNAVAILABLE), or
  // ATTNRT_DISABLE names it (then init() is never called). Logged at info level; every other
  // reason (not loadable, missing symbol, another ABI, a null required pointer, a duplicate
  // name, init failing otherwise) is a warning.
  bool expected = false;
};

struct Report {
  std::vector<OpDeviceReport> ops;
  std::vector<PluginLoadRecord> plugins;
  std::vector<std::string> plugin_search_path;
  std::vector<std::string> warnings;  // one-time warnings issued so far, in order
  int64_t plan_cache_hits = 0, plan_cache_misses = 0;
  std::string to_string() const;
  std::string to_json() const;
};

class Runtime {
 public:
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // Devices some backend can serve, host first.
  std::vector<Device> devices() const;
  // Every backend known, in priority order (highest first).
  std::vector<std::string> backend_names() const;

  // Validates `problem` and `layout` and returns a plan served by the first backend that
  // accepts it. Plans are cached under the complete (problem, layout) key.
  std::shared_ptr<const Plan> plan(const Problem& problem, const BatchLayout& layout);
  // Validates `tensors` against the plan and runs it.
  void run(const Plan& plan, const Tensors& tensors);
  // plan() then run().
  void execute(const Problem& problem, const BatchLayout& layout, const Tensors& tensors);
  // A plan for a new layout with the same request count that keeps the old plan's device
  // addresses when its backend can refresh in place (CUDA-graph replay); else a fresh plan.
  // Refreshing in place changes the plan for every holder and drops it from the plan cache,
  // so plan() no longer returns it for its old layout; runs of it already in flight on other
  // threads finish first.
  std::shared_ptr<const Plan> update(const std::shared_ptr<const Plan>& plan,
                                     const BatchLayout& layout);

  // Every backend's probe answer for `problem` (on problem.device), in priority order.
  std::vector<BackendState> diagnose(const Problem& problem) const;
  // Preferred page size of the best backend for `device` (0 if none states one).
  int preferred_page_size(const Device& device) const;
  Report report() const;

  DeviceBuffer allocate(const Device& device, size_t bytes);
  void copy_to_device(const DeviceBuffer& dst, const void* src, size_t bytes, size_t offset = 0);
  void copy_to_host(void* dst, const DeviceBuffer& src, size_t bytes, size_t offset = 0);
  void synchronize(const Device& device);
  // What the device is, for people (e.g. "host, avx2 kernels", "NVIDIA H200, sm_90, 132 SMs,
  // ..."), without the device's own name; why not, if it cannot be described.
  std::string describe_device(const Device& device) const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnrt
