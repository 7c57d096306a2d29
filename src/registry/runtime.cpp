#include "attnrt/runtime.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <map>
#include <mutex>
#include <new>
#include <shared_mutex>
#include <tuple>
#include <unordered_map>

#include "attnrt/errors.h"
#include "attnrt/log.h"
#include "core/backend.h"
#include "core/hash.h"
#include "core/validate.h"
#include "registry/plugin_backend.h"
#include "registry/registry.h"

namespace attnrt {
namespace {

class HostMemory : public DeviceMemory {
 public:
  void* alloc(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw Error("out of host memory allocating " + std::to_string(bytes) + " bytes");
    return p;
  }
  void free(void* p) noexcept override { std::free(p); }
};

bool same_problem(const Problem& a, const Problem& b) {
  return a.signature() == b.signature() && a.op == b.op && a.device == b.device &&
         a.q_dtype == b.q_dtype && a.kv_dtype == b.kv_dtype && a.page_size == b.page_size &&
         a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.sm_scale == b.sm_scale && a.has_sink == b.has_sink &&
         a.write_lse == b.write_lse && a.num_index_heads == b.num_index_heads &&
         a.index_dim == b.index_dim && a.block_size == b.block_size && a.topk == b.topk &&
         a.init_blocks == b.init_blocks && a.local_blocks == b.local_blocks &&
         a.score_type == b.score_type && a.index_scale == b.index_scale;
}

using OpDevKey = std::tuple<int, int, int>;  // op, device kind, device index
OpDevKey op_dev_key(Op op, const Device& d) {
  return {static_cast<int>(op), static_cast<int>(d.kind), d.index};
}

}  // namespace

struct Plan::State {
  Problem problem;
  BatchLayout layout;
  MaxPage max_page;  // validated layout's largest page id, checked against each run's pools
  mutable std::shared_mutex mu;  // guards layout and max_page (update) and backend and bplan (fallback)
  Backend* backend = nullptr;
  std::unique_ptr<BackendPlan> bplan;
};

Plan::Plan(std::unique_ptr<State> s) : state_(std::move(s)) {}
Plan::~Plan() = default;
const Problem& Plan::problem() const { return state_->problem; }
BatchLayout Plan::layout() const {
  std::shared_lock lock(state_->mu);
  return state_->layout;
}
std::string Plan::backend() const {
  std::shared_lock lock(state_->mu);
  return state_->backend ? state_->backend->name() : "";
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    owner_ = std::move(o.owner_);
    data_ = o.data_;
    size_ = o.size_;
    device_ = o.device_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}
DeviceBuffer::~DeviceBuffer() = default;

struct Runtime::Impl {
  explicit Impl(const RuntimeOptions& o) : registry(o) {}

  Registry registry;

  // --- devices, memory, workspaces
  std::mutex mem_mu;
  std::map<Device, std::shared_ptr<DeviceMemory>> memories;
  std::map<Device, std::unique_ptr<Workspace>> workspaces;

  Backend* memory_owner(const Device& d) {
    if (d.is_host()) return nullptr;
    for (const auto& b : registry.backends()) {
      auto devs = b->devices();
      if (std::find(devs.begin(), devs.end(), d) != devs.end() && b->device_memory(d)) return b.get();
    }
    throw BackendUnavailable("(none)", "memory", d.str(),
                             "no loaded backend serves device " + d.str() + no_device_hint(d));
  }
  std::string no_device_hint(const Device& d) const {
    std::string s;
    for (const auto& r : registry.plugin_records())
      if (!r.loaded) s += "; " + r.path + ": " + r.reason;
    return s;
  }
  std::shared_ptr<DeviceMemory> memory(const Device& d) {
    std::lock_guard lock(mem_mu);
    auto& m = memories[d];
    if (!m) m = d.is_host() ? std::make_shared<HostMemory>() : memory_owner(d)->device_memory(d);
    return m;
  }
  Workspace& workspace(const Device& d) {
    auto mem = memory(d);
    std::lock_guard lock(mem_mu);
    auto& w = workspaces[d];
    if (!w) w = std::make_unique<Workspace>(d, mem);
    return *w;
  }

  // --- health, canaries, warnings, statistics
  std::mutex state_mu;
  std::map<std::tuple<std::string, int, int, int>, std::string> unavailable;  // (backend, op, dev)
  std::map<std::tuple<std::string, int, int, uint64_t>, std::string> canaries;  // result per sig
  // A plugin that failed a canary on a device is unavailable there for every op: it computes
  // wrong numbers or cannot run at all, whichever op showed it. (backend, device kind, index)
  std::map<std::tuple<std::string, int, int>, std::string> canary_failed;
  std::set<std::string> warned;
  std::vector<std::string> warnings;
  std::map<OpDevKey, OpDeviceReport> stats;
  int64_t cache_hits = 0, cache_misses = 0;

  std::tuple<std::string, int, int, int> health_key(const Backend* b, const Problem& p) {
    return {b->name(), static_cast<int>(p.op), static_cast<int>(p.device.kind), p.device.index};
  }
  std::string marked(const Backend* b, const Problem& p) {
    std::lock_guard lock(state_mu);
    auto dev = canary_failed.find({b->name(), static_cast<int>(p.device.kind), p.device.index});
    if (dev != canary_failed.end()) return dev->second;
    auto it = unavailable.find(health_key(b, p));
    return it == unavailable.end() ? "" : it->second;
  }
  void mark(const Backend* b, const Problem& p, const std::string& reason) {
    std::lock_guard lock(state_mu);
    unavailable.emplace(health_key(b, p), reason);
  }
  void warn_once(const std::string& key, const std::string& msg) {
    {
      std::lock_guard lock(state_mu);
      if (!warned.insert(key).second) return;
      warnings.push_back(msg);
    }
    log(LogLevel::warn, msg);
  }

  // Runs (once per backend, device and problem signature) the canary of a plugin.
  std::string canary(Backend* b, const Problem& p) {
    if (!registry.options().canary || !registry.is_plugin(b)) return {};
    auto key = std::make_tuple(b->name(), static_cast<int>(p.device.kind), p.device.index, p.signature());
    {
      std::lock_guard lock(state_mu);
      auto it = canaries.find(key);
      if (it != canaries.end()) return it->second;
    }
    std::string r = run_canary(*b, p, workspace(p.device));
    std::lock_guard lock(state_mu);
    return canaries.emplace(key, r).first->second;
  }

  // One failure of a candidate during selection (plan, run or canary). A canary failure makes
  // the backend unavailable on the whole device, and is warned about once per device.
  struct Failure {
    Backend* backend;
    std::string reason;
    bool device_wide = false;
  };

  // Chooses a backend for the plan and plans on it. Caller holds the plan's exclusive lock.
  // `failures` are carried in from a failed run. Throws BackendUnavailable, leaving s.backend
  // null, when no candidate can serve, or in strict mode when the one that could is a fallback.
  void select(Plan::State& s, std::vector<Failure> failures) {
    const Problem& p = s.problem;
    const bool forced = !registry.options().forced.empty();
    const bool strict = registry.options().strict;
    std::vector<BackendState> skipped;
    if (forced && !registry.find(registry.options().forced)) {
      throw BackendUnavailable(registry.options().forced, op_name(p.op), p.device.str(),
                               "plugin failed to load: " + registry.load_failure(registry.options().forced));
    }
    auto cands = registry.candidates(p.device);
    if (cands.empty()) {
      if (forced)
        throw BackendUnavailable(registry.options().forced, op_name(p.op), p.device.str(),
                                 "backend does not serve device " + p.device.str());
      throw BackendUnavailable("(none)", op_name(p.op), p.device.str(),
                               "no backend serves device " + p.device.str() + no_device_hint(p.device));
    }
    // Candidates that failed earlier in this Runtime (plan, run or canary) and are marked:
    // serving the call after skipping one is a fallback, which strict mode refuses on every
    // call, not only the first. A probe that says Unavailable is not a failure.
    std::vector<Failure> earlier;
    auto failed_already = [&](const Backend* b) {
      return std::any_of(failures.begin(), failures.end(), [&](const Failure& f) { return f.backend == b; });
    };
    for (Backend* b : cands) {
      // A backend marked unavailable is a fallback only where it would serve the problem (a
      // canary failure marks every op of the device, also ones its probe declines).
      std::string why = marked(b, p);
      const Availability a = b->probe(p);
      if (!why.empty() && a && !failed_already(b)) earlier.push_back({b, why});
      if (why.empty() && !a) why = a.reason;
      if (why.empty() && strict && (!failures.empty() || !earlier.empty())) {
        const Failure& f = !failures.empty() ? failures.front() : earlier.front();
        throw BackendUnavailable(f.backend->name(), op_name(p.op), p.device.str(),
                                 f.reason + " (ATTNRT_STRICT=1: fallback to '" + b->name() +
                                     "' refused)");
      }
      if (why.empty()) {
        std::string c = canary(b, p);
        if (!c.empty()) {
          {
            std::lock_guard lock(state_mu);
            canary_failed.emplace(std::make_tuple(b->name(), static_cast<int>(p.device.kind),
                                                  p.device.index),
                                  c + " (canary of " + op_name(p.op) + ")");
          }
          failures.push_back({b, c, true});
          why = c;
        }
      }
      if (why.empty()) {
        try {
          s.bplan = b->plan(p, s.layout, workspace(p.device));
          s.backend = b;
        } catch (const BackendUnavailable& e) {
          why = e.reason();
          mark(b, p, why);
          failures.push_back({b, why});
        }
      }
      if (s.backend) break;
      if (forced) throw BackendUnavailable(b->name(), op_name(p.op), p.device.str(), why);
      skipped.push_back({b->name(), false, why});
    }
    if (!s.backend) {
      std::string all;
      for (const auto& k : skipped) all += "; " + k.backend + ": " + k.reason;
      throw BackendUnavailable("(none)", op_name(p.op), p.device.str(),
                               "no backend can serve " + p.describe() + all);
    }
    for (const Failure& f : failures) {
      if (f.device_wide)
        warn_once(f.backend->name() + "|" + p.device.str(),
                  "backend '" + f.backend->name() + "' unavailable on " + p.device.str() + ": " +
                      f.reason + " (canary of " + op_name(p.op) + "); using '" +
                      s.backend->name() + "' instead");
      else
        warn_once(f.backend->name() + "|" + op_name(p.op) + "|" + p.device.str(),
                  "backend '" + f.backend->name() + "' unavailable for " + op_name(p.op) + " on " +
                      p.device.str() + ": " + f.reason + "; using '" + s.backend->name() + "' instead");
    }
    std::lock_guard lock(state_mu);
    OpDeviceReport& r = stats[op_dev_key(p.op, p.device)];
    r.op = p.op;
    r.device = p.device;
    r.chosen = s.backend->name();
    r.skipped = skipped;
    r.fallbacks += static_cast<int64_t>(failures.size());
  }

  // --- plan cache: exact, LRU
  struct CacheEntry {
    std::shared_ptr<const Plan> plan;
    std::list<uint64_t>::iterator lru;
  };
  std::mutex cache_mu;
  std::unordered_multimap<uint64_t, CacheEntry> cache;
  std::list<uint64_t> lru;  // most recent first

  static uint64_t cache_key(const Problem& p, const BatchLayout& l) {
    return Hasher().add(p.signature()).add(l.fingerprint()).value();
  }
  std::shared_ptr<const Plan> cache_find(uint64_t key, const Problem& p, const BatchLayout& l) {
    std::lock_guard lock(cache_mu);
    auto range = cache.equal_range(key);
    for (auto it = range.first; it != range.second; ++it) {
      // No plan lock: update() takes a plan out of the cache before it changes its layout.
      const Plan::State& st = *it->second.plan->state_;
      if (same_problem(st.problem, p) && st.layout == l) {
        lru.splice(lru.begin(), lru, it->second.lru);
        return it->second.plan;
      }
    }
    return nullptr;
  }
  void cache_erase(const Plan* plan) {
    std::lock_guard lock(cache_mu);
    for (auto it = cache.begin(); it != cache.end();) {
      if (it->second.plan.get() == plan) {
        lru.erase(it->second.lru);
        it = cache.erase(it);
      } else {
        ++it;
      }
    }
  }
  void cache_put(uint64_t key, std::shared_ptr<const Plan> plan) {
    std::lock_guard lock(cache_mu);
    lru.push_front(key);
    cache.emplace(key, CacheEntry{std::move(plan), lru.begin()});
    while (cache.size() > registry.options().plan_cache_capacity) {
      uint64_t victim = lru.back();
      auto range = cache.equal_range(victim);
      for (auto it = range.first; it != range.second; ++it)
        if (it->second.lru == std::prev(lru.end())) {
          cache.erase(it);
          break;
        }
      lru.pop_back();
    }
  }
};

Runtime::Runtime(RuntimeOptions options) : impl_(std::make_unique<Impl>(options)) {
  // One warning per plugin file that could not be used because it is defective: a broken
  // fast path is never silent. A plugin whose runtime or hardware is absent here, or that is
  // disabled, was logged at info level by the loader; doctor and report() list it either way.
  for (const auto& r : impl_->registry.plugin_records())
    if (!r.loaded && !r.expected)
      impl_->warn_once("load|" + r.path, "plugin " + (r.name.empty() ? r.path : "'" + r.name + "' (" + r.path + ")") +
                                            " not used: " + r.reason);
}
Runtime::~Runtime() = default;

std::vector<Device> Runtime::devices() const {
  std::vector<Device> out{Device::cpu()};
  for (const auto& b : impl_->registry.backends())
    for (const Device& d : b->devices())
      if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  return out;
}

std::vector<std::string> Runtime::backend_names() const {
  std::vector<std::string> out;
  for (const auto& b : impl_->registry.backends()) out.push_back(b->name());
  return out;
}

std::shared_ptr<const Plan> Runtime::plan(const Problem& problem, const BatchLayout& layout) {
  validate_problem(problem);
  MaxPage max_page = validate_layout(problem, layout);
  const bool reuse = !impl_->registry.options().force_replan;
  uint64_t key = Impl::cache_key(problem, layout);
  if (reuse) {
    if (auto hit = impl_->cache_find(key, problem, layout)) {
      std::lock_guard lock(impl_->state_mu);
      ++impl_->cache_hits;
      return hit;
    }
  }
  auto state = std::make_unique<Plan::State>();
  state->problem = problem;
  state->layout = layout;
  state->max_page = max_page;
  {
    std::unique_lock lock(state->mu);
    impl_->select(*state, {});
  }
  std::shared_ptr<const Plan> plan(new Plan(std::move(state)));
  {
    std::lock_guard lock(impl_->state_mu);
    ++impl_->cache_misses;
  }
  if (reuse) impl_->cache_put(key, plan);
  return plan;
}

void Runtime::run(const Plan& plan, const Tensors& tensors) {
  Plan::State& s = *plan.state_;
  Workspace& ws = impl_->workspace(s.problem.device);
  std::vector<Impl::Failure> failures;
  for (;;) {
    Backend* used = nullptr;
    {
      // One lock from the check to the backend's run: update() may change the layout of a
      // shared plan, and the backend must run the very layout the tensors were checked against.
      std::shared_lock lock(s.mu);
      validate_tensors(s.problem, s.layout, s.max_page, tensors);
      used = s.backend;
      if (used) {
        try {
          used->run(*s.bplan, s.problem, s.layout, tensors, ws);
          break;
        } catch (const BackendUnavailable& e) {
          if (!impl_->registry.options().forced.empty()) throw;
          impl_->mark(used, s.problem, e.reason());
          failures.push_back({used, e.reason()});
        }
      }
    }
    // The backend failed, or an earlier failed selection left the plan without one: select
    // again. select throws BackendUnavailable with the recorded reasons when nothing is left.
    std::unique_lock lock(s.mu);
    if (s.backend == used) {  // else another thread switched the plan already
      s.backend = nullptr;
      s.bplan.reset();
      impl_->select(s, std::move(failures));
    }
    failures.clear();
  }
  std::lock_guard lock(impl_->state_mu);
  ++impl_->stats[op_dev_key(s.problem.op, s.problem.device)].calls;
}

void Runtime::execute(const Problem& problem, const BatchLayout& layout, const Tensors& tensors) {
  run(*plan(problem, layout), tensors);
}

std::shared_ptr<const Plan> Runtime::update(const std::shared_ptr<const Plan>& old,
                                            const BatchLayout& layout) {
  Plan::State& s = *old->state_;
  const Problem& p = s.problem;
  bool same_requests;
  {
    std::shared_lock lock(s.mu);
    same_requests = layout.num_requests() == s.layout.num_requests();
  }
  if (!same_requests) return plan(p, layout);
  MaxPage max_page = validate_layout(p, layout);
  // The plan changes in place: it no longer answers plan() for its old layout.
  impl_->cache_erase(old.get());
  std::unique_lock lock(s.mu);
  if (s.backend && s.backend->update_plan(*s.bplan, p, layout)) {
    s.layout = layout;
    s.max_page = max_page;
    return old;
  }
  lock.unlock();
  return plan(p, layout);
}

std::vector<BackendState> Runtime::diagnose(const Problem& problem) const {
  std::vector<BackendState> out;
  Problem p = problem;
  for (const auto& b : impl_->registry.backends()) {
    BackendState st{b->name(), false, ""};
    auto devs = b->devices();
    if (impl_->registry.options().disabled.count(b->name())) {
      st.reason = "disabled by ATTNRT_DISABLE";
    } else if (std::find(devs.begin(), devs.end(), p.device) == devs.end()) {
      st.reason = "does not serve device " + p.device.str();
    } else if (std::string m = impl_->marked(b.get(), p); !m.empty()) {
      st.reason = m;
    } else {
      try {
        validate_problem(p);
        Availability a = b->probe(p);
        st.available = a.available;
        st.reason = a.reason;
      } catch (const InvalidArgument& e) {
        st.reason = e.what();
      }
    }
    out.push_back(std::move(st));
  }
  for (const auto& r : impl_->registry.plugin_records())
    if (!r.loaded) out.push_back({r.name.empty() ? r.path : r.name, false, "not loaded: " + r.reason});
  return out;
}

int Runtime::preferred_page_size(const Device& device) const {
  for (Backend* b : impl_->registry.candidates(device)) {
    int ps = b->preferences(device).page_size;
    if (ps > 0) return ps;
  }
  return 0;
}

Report Runtime::report() const {
  Report r;
  r.plugins = impl_->registry.plugin_records();
  r.plugin_search_path = impl_->registry.search_path();
  {
    std::lock_guard lock(impl_->state_mu);
    for (const auto& [k, v] : impl_->stats) r.ops.push_back(v);
    r.warnings = impl_->warnings;
    r.plan_cache_hits = impl_->cache_hits;
    r.plan_cache_misses = impl_->cache_misses;
  }
  // Outside the lock: a backend may wait for its device to answer.
  for (OpDeviceReport& o : r.ops)
    if (const Backend* b = o.chosen.empty() ? nullptr : impl_->registry.find(o.chosen)) {
      DegradedRuns d = b->degraded_runs(o.device, o.op);
      o.degraded_runs = d.count;
      o.degraded_note = std::move(d.note);
    }
  return r;
}

DeviceBuffer Runtime::allocate(const Device& device, size_t bytes) {
  auto mem = impl_->memory(device);
  DeviceBuffer b;
  b.data_ = mem->alloc(bytes == 0 ? 1 : bytes);
  b.size_ = bytes;
  b.device_ = device;
  void* p = b.data_;
  b.owner_ = std::shared_ptr<void>(p, [mem](void* q) { mem->free(q); });
  return b;
}

void Runtime::copy_to_device(const DeviceBuffer& dst, const void* src, size_t bytes, size_t offset) {
  if (offset + bytes > dst.size())
    throw InvalidArgument("copy_to_device: " + std::to_string(bytes) + " bytes at offset " +
                          std::to_string(offset) + " exceed the buffer's " + std::to_string(dst.size()));
  char* d = static_cast<char*>(dst.data()) + offset;
  if (dst.device().is_host()) {
    std::memcpy(d, src, bytes);
    return;
  }
  impl_->memory_owner(dst.device())->copy_to_device(dst.device(), d, src, bytes);
}

void Runtime::copy_to_host(void* dst, const DeviceBuffer& src, size_t bytes, size_t offset) {
  if (offset + bytes > src.size())
    throw InvalidArgument("copy_to_host: " + std::to_string(bytes) + " bytes at offset " +
                          std::to_string(offset) + " exceed the buffer's " + std::to_string(src.size()));
  const char* s = static_cast<const char*>(src.data()) + offset;
  if (src.device().is_host()) {
    std::memcpy(dst, s, bytes);
    return;
  }
  impl_->memory_owner(src.device())->copy_to_host(src.device(), dst, s, bytes);
}

void Runtime::synchronize(const Device& device) {
  if (device.is_host()) return;
  impl_->memory_owner(device)->synchronize(device);
}

std::string Runtime::describe_device(const Device& device) const {
  if (device.is_host())
    return std::string("host, ") + cpu_isa_name(impl_->registry.options().cpu_isa) + " kernels";
  try {
    return impl_->memory_owner(device)->describe_device(device);
  } catch (const Error& e) {
    return e.what();
  }
}

}  // namespace attnrt
