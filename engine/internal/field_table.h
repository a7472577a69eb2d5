// A stats type described once: a table of its fields (name, kind, member),
// over which copying a step's share and writing JSON are loops. A new counter
// is two edits: the field, and its row.
//
//   const FieldTable<ZeroStats> kZeroFields = {
//       {"param_bytes", FieldKind::kNow, &ZeroStats::param_bytes},
//       {"allgather_bytes", FieldKind::kTotal, &ZeroStats::allgather_bytes}};
//   subtract_totals(kZeroFields, now, before);   // now holds the share since before
//   write_fields(kZeroFields, stats, json);       // json["param_bytes"] = ...
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <variant>
#include <vector>

namespace remat::internal {

// What a value says, and so what a step's share of it is.
enum class FieldKind {
  kTotal,  // summed since the start: a step's share is the difference
  kNow,    // held at the moment of reading: a step's share is the value read
  kPeak,   // the highest since its reset: a step's share is the value read
};

template <class S>
class Field {
 public:
  // Members of the types counters hold; a JSON value keeps its type (ints
  // stay ints, doubles doubles).
  using Member = std::variant<int64_t S::*, int S::*, double S::*>;

  Field(const char* name, FieldKind kind, Member member) : name_(name), kind_(kind), member_(member) {}
  Field(const char* name, Member member) : Field(name, FieldKind::kNow, member) {}

  const char* name() const { return name_; }
  FieldKind kind() const { return kind_; }

  // s.member -= before.member
  void subtract(S& s, const S& before) const {
    std::visit([&](auto m) { s.*m -= before.*m; }, member_);
  }
  void write(const S& s, nlohmann::json& out) const {
    std::visit([&](auto m) { out[name_] = s.*m; }, member_);
  }

 private:
  const char* name_;
  FieldKind kind_;
  Member member_;
};

template <class S>
using FieldTable = std::vector<Field<S>>;

// `now` becomes its share since `before`: totals as differences, the rest as
// read.
template <class S>
void subtract_totals(const FieldTable<S>& table, S& now, const S& before) {
  for (const auto& field : table) {
    if (field.kind() == FieldKind::kTotal) field.subtract(now, before);
  }
}

// Every field of `s` into `out`, by its name.
template <class S>
void write_fields(const FieldTable<S>& table, const S& s, nlohmann::json& out) {
  for (const auto& field : table) field.write(s, out);
}

}  // namespace remat::internal
