// The engine's JSON side of field tables (runtime/field_table.h): a stats
// type's fields, or the metrics a step's counters give, written by name.
//
//   write_fields(table, stats, json);  // json["param_bytes"] = ...
//   write_values(counters.metrics(), json);
#pragma once

#include <nlohmann/json.hpp>
#include <variant>

#include "runtime/field_table.h"

namespace remat::internal {

// Every field of `s` into `out`, by its name, in its own type.
template <class S>
void write_fields(const FieldTable<S>& table, const S& s, nlohmann::json& out) {
  for (const auto& field : table) {
    std::visit([&](auto v) { out[field.name()] = v; }, field.value(s));
  }
}

// Each value into `out`, by its key, in its own type.
inline void write_values(const MetricValues& values, nlohmann::json& out) {
  for (const auto& [key, value] : values) {
    std::visit([&, k = key](auto v) { out[k] = v; }, value);
  }
}

}  // namespace remat::internal
