#include "attnrt/errors.h"

namespace attnrt {

BackendUnavailable::BackendUnavailable(std::string backend, std::string op, std::string device,
                                       std::string reason)
    : Error("backend '" + backend + "' unavailable for " + op + " on " + device + ": " + reason),
      backend_(std::move(backend)),
      op_(std::move(op)),
      device_(std::move(device)),
      reason_(std::move(reason)) {}

}  // namespace attnrt
