// Paged KV cache pools and the request page allocator.
#include "attnrt/kv_cache.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "attnrt/errors.h"

namespace attnrt {
namespace {

void check_field(bool ok, const std::string& field, int64_t value, const char* expected) {
  if (!ok)
    throw InvalidArgument("KvCacheConfig." + field + ": got " + std::to_string(value) + ", expected " + expected);
}

}  // namespace

PagedKvCache::PagedKvCache(Runtime& runtime, const KvCacheConfig& c) : config_(c) {
  check_field(c.num_layers > 0, "num_layers", c.num_layers, ">= 1");
  check_field(c.num_pages > 0, "num_pages", c.num_pages, ">= 1");
  check_field(c.page_size > 0, "page_size", c.page_size, ">= 1");
  check_field(c.num_kv_heads > 0, "num_kv_heads", c.num_kv_heads, ">= 1");
  check_field(c.head_dim > 0, "head_dim", c.head_dim, ">= 1");
  if (c.dtype == DType::i32) throw InvalidArgument("KvCacheConfig.dtype: got i32, expected f32, f16 or bf16");
  check_field(c.layer_has_index.empty() || static_cast<int>(c.layer_has_index.size()) == c.num_layers,
              "layer_has_index.size()", static_cast<int64_t>(c.layer_has_index.size()), "0 or num_layers");
  const bool any_index = std::find(c.layer_has_index.begin(), c.layer_has_index.end(), true) != c.layer_has_index.end();
  if (any_index) check_field(c.index_dim > 0, "index_dim", c.index_dim, ">= 1 when a layer has an index pool");
  config_.layer_has_index.resize(c.num_layers, false);

  const size_t es = dtype_size(c.dtype);
  const size_t slots = static_cast<size_t>(c.num_pages) * c.page_size;
  for (int l = 0; l < c.num_layers; ++l) {
    k_.push_back(runtime.allocate(c.device, slots * c.num_kv_heads * c.head_dim * es));
    v_.push_back(runtime.allocate(c.device, slots * c.num_kv_heads * c.head_dim * es));
    ik_.push_back(config_.layer_has_index[l] ? runtime.allocate(c.device, slots * c.index_dim * es) : DeviceBuffer{});
  }
}

TensorView PagedKvCache::pool(const DeviceBuffer& buf, int heads, int dim) const {
  return TensorView::contiguous(buf.data(), config_.dtype, config_.device,
                                {config_.num_pages, config_.page_size, heads, dim});
}

static void check_layer(int layer, int n) {
  if (layer < 0 || layer >= n)
    throw InvalidArgument("layer: got " + std::to_string(layer) + ", expected 0.." + std::to_string(n - 1));
}

TensorView PagedKvCache::k(int layer) const {
  check_layer(layer, config_.num_layers);
  return pool(k_[layer], config_.num_kv_heads, config_.head_dim);
}

TensorView PagedKvCache::v(int layer) const {
  check_layer(layer, config_.num_layers);
  return pool(v_[layer], config_.num_kv_heads, config_.head_dim);
}

bool PagedKvCache::has_index(int layer) const {
  check_layer(layer, config_.num_layers);
  return config_.layer_has_index[layer];
}

TensorView PagedKvCache::index_k(int layer) const {
  if (!has_index(layer))
    throw InvalidArgument("layer " + std::to_string(layer) + " has no index-key pool (it is a dense layer)");
  return pool(ik_[layer], 1, config_.index_dim);
}

size_t PagedKvCache::bytes() const {
  size_t total = 0;
  for (int l = 0; l < config_.num_layers; ++l) total += k_[l].size() + v_[l].size() + ik_[l].size();
  return total;
}

PageAllocator::PageAllocator(int num_pages, int page_size, uint64_t seed) : page_size_(page_size) {
  if (num_pages <= 0)
    throw InvalidArgument("PageAllocator num_pages: got " + std::to_string(num_pages) + ", expected >= 1");
  if (page_size <= 0)
    throw InvalidArgument("PageAllocator page_size: got " + std::to_string(page_size) + ", expected >= 1");
  free_.resize(num_pages);
  std::iota(free_.begin(), free_.end(), 0);
  std::mt19937_64 gen(seed);
  std::shuffle(free_.begin(), free_.end(), gen);
}

PageAllocator::RequestId PageAllocator::create() {
  reqs_.push_back(Req{true, 0, {}});
  return static_cast<RequestId>(reqs_.size() - 1);
}

const PageAllocator::Req& PageAllocator::req(RequestId r) const {
  if (r < 0 || static_cast<size_t>(r) >= reqs_.size() || !reqs_[r].live)
    throw InvalidArgument("request id: got " + std::to_string(r) + ", expected a live request from create()");
  return reqs_[r];
}

void PageAllocator::append(RequestId r, int n) {
  req(r);
  if (n < 0) throw InvalidArgument("append: token count " + std::to_string(n) + ", expected >= 0");
  Req& q = reqs_[r];
  const int64_t new_len = int64_t{q.len} + n;
  const int64_t need = (new_len + page_size_ - 1) / page_size_ - static_cast<int64_t>(q.pages.size());
  if (need > static_cast<int64_t>(free_.size()))
    throw InvalidArgument("append: request " + std::to_string(r) + " needs " + std::to_string(need) +
                          " more pages for " + std::to_string(new_len) + " tokens, but only " +
                          std::to_string(free_.size()) + " are free");
  for (int64_t i = 0; i < need; ++i) {
    q.pages.push_back(free_.back());
    free_.pop_back();
  }
  q.len = static_cast<int>(new_len);
}

void PageAllocator::free(RequestId r) {
  req(r);
  Req& q = reqs_[r];
  free_.insert(free_.end(), q.pages.rbegin(), q.pages.rend());
  q = Req{};
}

int PageAllocator::length(RequestId r) const {
  return req(r).len;
}

const std::vector<int32_t>& PageAllocator::pages(RequestId r) const {
  return req(r).pages;
}

BatchLayout PageAllocator::layout(const std::vector<RequestId>& reqs, const std::vector<int32_t>& q_lens) const {
  if (reqs.size() != q_lens.size())
    throw InvalidArgument("layout: " + std::to_string(reqs.size()) + " requests but " +
                          std::to_string(q_lens.size()) + " q_lens, expected equal counts");
  std::vector<int32_t> kv;
  std::vector<std::vector<int32_t>> pg;
  for (RequestId r : reqs) {
    kv.push_back(length(r));
    pg.push_back(pages(r));
  }
  return BatchLayout::make(page_size_, q_lens, std::move(kv), pg);
}

}  // namespace attnrt
