#include <algorithm>
#include <cstdlib>
#include <new>

#include "core/backend.h"

namespace attnrt {

Workspace::Workspace(Device device, std::shared_ptr<DeviceMemory> memory)
    : device_(device), memory_(std::move(memory)) {}

Workspace::~Workspace() {
  for (const Buffer& b : free_) memory_->free(b.data);
}

Workspace::Lease::Lease(Lease&& o) noexcept
    : owner_(o.owner_), data_(o.data_), size_(o.size_) {
  o.owner_ = nullptr;
  o.data_ = nullptr;
  o.size_ = 0;
}

Workspace::Lease& Workspace::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    if (owner_) owner_->give_back(data_, size_);
    owner_ = o.owner_;
    data_ = o.data_;
    size_ = o.size_;
    o.owner_ = nullptr;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

Workspace::Lease::~Lease() {
  if (owner_) owner_->give_back(data_, size_);
}

Workspace::Lease Workspace::acquire(size_t bytes) {
  bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  Lease l;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Smallest free buffer that fits.
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it)
      if (it->size >= bytes && (best == free_.end() || it->size < best->size)) best = it;
    if (best != free_.end()) {
      l.owner_ = this;
      l.data_ = best->data;
      l.size_ = best->size;
      free_.erase(best);
      return l;
    }
    // None fits: drop the largest too-small one (it would never be picked again for this size).
    if (!free_.empty()) {
      auto big = std::max_element(free_.begin(), free_.end(),
                                  [](const Buffer& a, const Buffer& b) { return a.size < b.size; });
      memory_->free(big->data);
      reserved_ -= big->size;
      free_.erase(big);
    }
    reserved_ += bytes;
  }
  try {
    l.data_ = memory_->alloc(bytes);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= bytes;  // and no lease owns anything: nothing goes back to the free list
    throw;
  }
  l.owner_ = this;
  l.size_ = bytes;
  return l;
}

void Workspace::give_back(void* p, size_t n) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back({p, n});
}

size_t Workspace::bytes_reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

}  // namespace attnrt
