// The reference backend: exact attnrt semantics, written for clarity, accumulating in double.
// The ground truth for tests, canaries and `attnrt run --check`. Host memory only.
#pragma once

#include <memory>

#include "core/backend.h"

namespace attnrt {

std::unique_ptr<Backend> make_reference_backend();

// Computes `problem` on host tensors directly (no plan); inputs assumed validated.
void reference_compute(const Problem& problem, const BatchLayout& layout, const Tensors& tensors);

}  // namespace attnrt
