// Paged KV cache storage and a page allocator for requests.
//
// PagedKvCache owns, per layer, K and V pools [num_pages, page_size, num_kv_heads, head_dim]
// and, for sparse layers, an index-key pool [num_pages, page_size, 1, index_dim], all on one
// device and all addressed by the same page ids. PageAllocator hands pages to requests and
// builds the BatchLayout of a step.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attnrt/problem.h"
#include "attnrt/runtime.h"
#include "attnrt/types.h"

namespace attnrt {

struct KvCacheConfig {
  int num_layers = 1;
  int num_pages = 0;
  int page_size = 16;
  int num_kv_heads = 1;
  int head_dim = 128;
  DType dtype = DType::bf16;
  Device device{};
  // layer_has_index[l]: layer l is sparse and gets an index-key pool (size num_layers or empty).
  std::vector<bool> layer_has_index;
  int index_dim = 0;
};

class PagedKvCache {
 public:
  // Allocates every pool through `runtime` on config.device. Throws InvalidArgument on a bad
  // config (naming the field), or the allocator's error when memory runs out.
  PagedKvCache(Runtime& runtime, const KvCacheConfig& config);
  const KvCacheConfig& config() const { return config_; }
  TensorView k(int layer) const;
  TensorView v(int layer) const;
  // Index-key pool of a sparse layer; throws InvalidArgument for a layer without one.
  TensorView index_k(int layer) const;
  bool has_index(int layer) const;
  size_t bytes() const;

 private:
  TensorView pool(const DeviceBuffer& buf, int heads, int dim) const;
  KvCacheConfig config_;
  std::vector<DeviceBuffer> k_, v_, ik_;
};

// Assigns physical pages to requests. Pages are handed out in a scrambled order (not 0,1,2...)
// so that tests and runs exercise real page tables.
class PageAllocator {
 public:
  PageAllocator(int num_pages, int page_size, uint64_t seed = 1);
  using RequestId = int;
  RequestId create();
  // Grows the request by n tokens, taking new pages as needed. Throws InvalidArgument when the
  // pool is exhausted (names pages needed and free).
  void append(RequestId r, int n);
  void free(RequestId r);
  int length(RequestId r) const;
  const std::vector<int32_t>& pages(RequestId r) const;
  int free_pages() const { return static_cast<int>(free_.size()); }
  int page_size() const { return page_size_; }
  // Layout for a step in which request reqs[i] has q_lens[i] new tokens (already appended).
  BatchLayout layout(const std::vector<RequestId>& reqs, const std::vector<int32_t>& q_lens) const;

 private:
  struct Req {
    bool live = false;
    int len = 0;
    std::vector<int32_t> pages;
  };
  const Req& req(RequestId r) const;  // throws InvalidArgument unless r is live
  int page_size_;
  std::vector<int32_t> free_;
  std::vector<Req> reqs_;
};

}  // namespace attnrt
