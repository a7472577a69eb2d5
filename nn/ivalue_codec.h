// Typed C++ values to and from c10::IValue, so that code that runs a callable
// later (a checkpoint region's recompute, a module hook) can keep its
// arguments and results in one untyped form.
//
//   IValueFn f = erase_types<at::Tensor, int64_t>([](at::Tensor x, int64_t k) { return x * k; });
//   at::Tensor y = IValueCodec<at::Tensor>::decode(f({encode(x), encode(k)}));
//
// Supported: tensors, optional tensors, int, int64, float, double, bool,
// strings, and vectors, pairs and tuples of these.
#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace remat {

using IValueFn = std::function<c10::IValue(const std::vector<c10::IValue>&)>;

// IValueCodec<T>::encode(value) and ::decode(ivalue): one typed value to and
// from an IValue, for each supported type.
template <typename T>
struct IValueCodec {
  static c10::IValue encode(const T& v) { return c10::IValue(v); }
  static T decode(const c10::IValue& v) { return v.to<T>(); }
};

template <>
struct IValueCodec<int> {
  static c10::IValue encode(int v) { return c10::IValue(static_cast<int64_t>(v)); }
  static int decode(const c10::IValue& v) { return static_cast<int>(v.toInt()); }
};

template <>
struct IValueCodec<float> {
  static c10::IValue encode(float v) { return c10::IValue(static_cast<double>(v)); }
  static float decode(const c10::IValue& v) { return static_cast<float>(v.toDouble()); }
};

template <>
struct IValueCodec<const char*> {
  static c10::IValue encode(const char* v) { return c10::IValue(std::string(v)); }
};

template <typename T>
struct IValueCodec<std::vector<T>> {
  static c10::IValue encode(const std::vector<T>& v) {
    if constexpr (std::is_same_v<T, at::Tensor> || std::is_same_v<T, int64_t> ||
                  std::is_same_v<T, double> || std::is_same_v<T, bool>) {
      return c10::IValue(v);
    } else {
      std::vector<c10::IValue> items;
      for (const auto& x : v) items.push_back(IValueCodec<T>::encode(x));
      return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
    }
  }
  static std::vector<T> decode(const c10::IValue& v) {
    std::vector<T> out;
    if (v.isTuple()) {
      for (const auto& x : v.toTupleRef().elements()) out.push_back(IValueCodec<T>::decode(x));
    } else {
      for (const auto& x : v.toListRef()) out.push_back(IValueCodec<T>::decode(x));
    }
    return out;
  }
};

template <typename... Ts>
struct IValueCodec<std::tuple<Ts...>> {
  static c10::IValue encode(const std::tuple<Ts...>& t) {
    std::vector<c10::IValue> items;
    std::apply([&](const auto&... x) { (items.push_back(IValueCodec<std::decay_t<decltype(x)>>::encode(x)), ...); }, t);
    return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
  }
  static std::tuple<Ts...> decode(const c10::IValue& v) {
    const auto& items = v.toTupleRef().elements();
    return decode_items(items, std::index_sequence_for<Ts...>{});
  }
  template <size_t... I>
  static std::tuple<Ts...> decode_items(const std::vector<c10::IValue>& items,
                                        std::index_sequence<I...>) {
    return std::tuple<Ts...>(IValueCodec<Ts>::decode(items[I])...);
  }
};

template <typename T>
struct IValueCodec<std::pair<T, T>> {
  static c10::IValue encode(const std::pair<T, T>& p) {
    return IValueCodec<std::tuple<T, T>>::encode(std::make_tuple(p.first, p.second));
  }
  static std::pair<T, T> decode(const c10::IValue& v) {
    auto t = IValueCodec<std::tuple<T, T>>::decode(v);
    return {std::get<0>(t), std::get<1>(t)};
  }
};

// An argument's or result's type as a codec sees it: no reference, no const.
template <typename T>
using Plain = std::remove_cv_t<std::remove_reference_t<T>>;

namespace internal {

template <typename... Ts, size_t... I>
std::tuple<Ts...> decode_args(const std::vector<c10::IValue>& in, std::index_sequence<I...>) {
  return std::tuple<Ts...>(IValueCodec<Ts>::decode(in[I])...);
}

}  // namespace internal

// fn (taking Args...) as an IValueFn; fn is copied into it.
template <typename... Args, typename F>
IValueFn erase_types(F&& fn) {
  using Result = Plain<std::invoke_result_t<F&, Plain<Args>...>>;
  return [fn = std::decay_t<F>(std::forward<F>(fn))](
             const std::vector<c10::IValue>& in) mutable -> c10::IValue {
    return std::apply(
        [&](auto... decoded) { return IValueCodec<Result>::encode(fn(std::move(decoded)...)); },
        internal::decode_args<Plain<Args>...>(in, std::index_sequence_for<Args...>{}));
  };
}

}  // namespace remat
