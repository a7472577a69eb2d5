// Carrying a C++ value through a custom autograd Function: forward keeps it in
// the context's saved_data, backward reads it back. Any copyable or movable
// type, without casts to integers.
//
//   static variable_list forward(AutogradContext* ctx, const at::Tensor& x, Group group) {
//     remat::keep_in(ctx, "group", std::move(group));
//     ...
//   }
//   static variable_list backward(AutogradContext* ctx, variable_list grads) {
//     const Group& group = remat::kept_in<Group>(ctx, "group");
//     ...
//   }
#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <utility>

namespace remat {
namespace internal {

template <typename T>
struct Kept : torch::CustomClassHolder {
  explicit Kept(T v) : value(std::move(v)) {}
  T value;
};

}  // namespace internal

// `Context` is torch::autograd::AutogradContext (a template here so this
// header does not pull in the autograd headers).
template <typename T, typename Context>
void keep_in(Context* ctx, const std::string& key, T value) {
  ctx->saved_data[key] = c10::IValue::make_capsule(c10::make_intrusive<internal::Kept<T>>(std::move(value)));
}

// The value kept under `key` by keep_in<T>; it lives as long as the context.
template <typename T, typename Context>
T& kept_in(Context* ctx, const std::string& key) {
  return static_cast<internal::Kept<T>*>(ctx->saved_data.at(key).toCapsule().get())->value;
}

}  // namespace remat
