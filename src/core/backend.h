// The interface every backend implements (built-in ones directly, plugins through an adapter
// over the C ABI in attnrt/plugin.h). Contract: design.md §4.
//
//   probe  cheap, no side effects, honest: Unavailable{reason} whenever plan or run would not
//          work for this problem on this device.
//   plan   once per (problem, layout); may allocate and do host work; may throw
//          BackendUnavailable.
//   run    per layer; writes every element of the outputs, or throws BackendUnavailable before
//          writing any. Inputs were validated by the Runtime: a backend never re-validates user
//          input and never ignores a field of the Problem.
#pragma once

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attnrt/errors.h"
#include "attnrt/problem.h"

namespace attnrt {

struct Availability {
  bool available = true;
  std::string reason;  // empty when available
  static Availability yes() { return {}; }
  static Availability no(std::string why) { return {false, std::move(why)}; }
  explicit operator bool() const { return available; }
};

// Raw memory of one device, provided by whoever serves the device (host: aligned malloc).
struct DeviceMemory {
  virtual ~DeviceMemory() = default;
  virtual void* alloc(size_t bytes) = 0;  // throws on failure
  virtual void free(void* p) noexcept = 0;
};

// Scratch memory of one (Runtime, device). Concurrent callers each get their own buffer, so one
// Runtime can be used from many threads; buffers grow on demand and are reused. Never shared
// between Runtimes or devices.
class Workspace {
 public:
  Workspace(Device device, std::shared_ptr<DeviceMemory> memory);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&&) noexcept;
    Lease& operator=(Lease&&) noexcept;
    ~Lease();
    void* data() const { return data_; }
    size_t size() const { return size_; }
    template <typename T>
    T* as() const { return static_cast<T*>(data_); }

   private:
    friend class Workspace;
    Workspace* owner_ = nullptr;
    void* data_ = nullptr;
    size_t size_ = 0;
  };

  // A buffer of at least `bytes` bytes (64-byte aligned) for the caller's exclusive use until
  // the lease is destroyed.
  Lease acquire(size_t bytes);
  const Device& device() const { return device_; }
  size_t bytes_reserved() const;

 private:
  void give_back(void* p, size_t n) noexcept;
  struct Buffer {
    void* data;
    size_t size;
  };
  Device device_;
  std::shared_ptr<DeviceMemory> memory_;
  mutable std::mutex mu_;
  std::vector<Buffer> free_;
  size_t reserved_ = 0;
};

// Backend-owned state computed once per (problem, layout).
class BackendPlan {
 public:
  virtual ~BackendPlan() = default;
};

// Runs that went a slower way than their plan chose, results still correct (plugin.h,
// degraded_runs).
struct DegradedRuns {
  int64_t count = 0;
  std::string note;  // what is counted and why
};

struct BackendPreferences {
  int page_size = 0;  // 0: no preference
  std::string note;   // shown by doctor
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const std::string& name() const = 0;
  // Higher is tried first (reference 0, cpu 100, generic GPU 200, arch-specific above).
  virtual int priority() const = 0;
  // Devices this backend can serve on this machine.
  virtual std::vector<Device> devices() const = 0;
  virtual Availability probe(const Problem& problem) const = 0;
  virtual std::unique_ptr<BackendPlan> plan(const Problem& problem, const BatchLayout& layout,
                                            Workspace& ws) = 0;
  virtual void run(const BackendPlan& plan, const Problem& problem, const BatchLayout& layout,
                   const Tensors& tensors, Workspace& ws) = 0;
  // Refreshes `plan` in place for `layout` (same request count), keeping its device addresses.
  // Returns false when it cannot (the Runtime then plans anew). Default: cannot.
  virtual bool update_plan(BackendPlan& /*plan*/, const Problem& /*problem*/,
                           const BatchLayout& /*layout*/) {
    return false;
  }
  virtual BackendPreferences preferences(const Device& /*device*/) const { return {}; }
  // Runs of `op` on `device` since the backend started that went a slower way than their plan
  // chose. For reports: may wait for the device. Default: none ever do.
  virtual DegradedRuns degraded_runs(const Device& /*device*/, Op /*op*/) const { return {}; }
  // Memory of a device this backend serves that the host cannot address directly; nullptr for
  // host-memory backends.
  virtual std::shared_ptr<DeviceMemory> device_memory(const Device& /*device*/) { return nullptr; }
  // Host <-> device copies and synchronization for devices whose memory this backend owns.
  virtual void copy_to_device(const Device&, void* /*dst*/, const void* /*src*/, size_t /*n*/) {
    throw InternalError(name() + ": no device memory");
  }
  virtual void copy_to_host(const Device&, void* /*dst*/, const void* /*src*/, size_t /*n*/) {
    throw InternalError(name() + ": no device memory");
  }
  virtual void synchronize(const Device&) {}
  // What the device is, for people, without its name (Runtime::describe_device).
  virtual std::string describe_device(const Device&) const { return name() + " device"; }
};

}  // namespace attnrt
