// ST_ARG declares a chainable option: a trailing-underscore member, a setter
// that returns *this, and a getter, in the style of the LibTorch frontend:
//   AllReduceOptions().op(ReduceOp::Max).timeout(std::chrono::seconds(5))
// It leaves the access at private: declare other public members first.
#pragma once

#include <utility>

#define ST_ARG(T, name)                                   \
 public:                                                  \
  auto name(const T& value)->decltype(*this) {            \
    this->name##_ = value;                                \
    return *this;                                         \
  }                                                       \
  auto name(T&& value)->decltype(*this) {                 \
    this->name##_ = std::move(value);                     \
    return *this;                                         \
  }                                                       \
  const T& name() const noexcept { return this->name##_; } \
  T& name() noexcept { return this->name##_; }            \
                                                          \
 private:                                                 \
  T name##_
