// attnrt error types. Every failure that reaches a user is one of these.
//
//   InvalidArgument     the caller's input is wrong; the message names the field, the value and
//                       what was expected. Never triggers a backend fallback.
//   BackendUnavailable  a backend cannot serve this call (probe said no, plan or run refused, a
//                       plugin failed to load or failed its canary). Carries backend, op, device,
//                       reason. In automatic mode the Runtime catches it and tries the next backend.
//   InternalError       a bug in attnrt or a backend; propagates.
#pragma once

#include <stdexcept>
#include <string>

namespace attnrt {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

class BackendUnavailable : public Error {
 public:
  BackendUnavailable(std::string backend, std::string op, std::string device, std::string reason);
  const std::string& backend() const { return backend_; }
  const std::string& op() const { return op_; }
  const std::string& device() const { return device_; }
  const std::string& reason() const { return reason_; }

 private:
  std::string backend_, op_, device_, reason_;
};

class InternalError : public Error {
 public:
  using Error::Error;
};

}  // namespace attnrt
