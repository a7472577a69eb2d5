// A stats type described once, in the library that counts: a table of its
// fields (name, kind, member, and the key it has in a step's metrics, if any)
// over which every reader loops. A new counter is its field, its row and its
// increment.
//
//   struct MyStats {
//     int64_t sent_bytes = 0;  // total
//     int64_t held_bytes = 0;  // now
//     static const FieldTable<MyStats>& fields();
//   };
//   inline const FieldTable<MyStats>& MyStats::fields() {
//     static const FieldTable<MyStats> table = {
//         {"sent_bytes", FieldKind::kTotal, &MyStats::sent_bytes, "my_sent_bytes"},  // a metric
//         {"held_bytes", FieldKind::kNow, &MyStats::held_bytes}};                    // not one
//     return table;
//   }
//   subtract_totals(MyStats::fields(), now, before);  // now holds the share since before
//   append_metrics(MyStats::fields(), now, out);      // out += {"my_sent_bytes", now.sent_bytes}
#pragma once

#include <cstdint>
#include <utility>
#include <variant>
#include <vector>

namespace remat {

// What a value says, and so what a step's share of it is.
enum class FieldKind {
  kTotal,  // summed since the start: a step's share is the difference
  kNow,    // held at the moment of reading: a step's share is the value read
  kPeak,   // the highest since its reset: a step's share is the value read
};

// A field's value, in the type it is kept in (ints stay ints, doubles doubles).
using FieldValue = std::variant<int64_t, int, double>;

template <class S>
class Field {
 public:
  using Member = std::variant<int64_t S::*, int S::*, double S::*>;

  // `metric`: the field's key in a step's metrics (remat-train's JSON lines);
  // null: not a metric.
  Field(const char* name, FieldKind kind, Member member, const char* metric = nullptr)
      : name_(name), kind_(kind), member_(member), metric_(metric) {}
  Field(const char* name, Member member) : Field(name, FieldKind::kNow, member) {}

  const char* name() const { return name_; }
  FieldKind kind() const { return kind_; }
  const char* metric() const { return metric_; }
  const Member& member() const { return member_; }

  FieldValue value(const S& s) const {
    return std::visit([&](auto m) { return FieldValue(s.*m); }, member_);
  }
  // s.member -= before.member
  void subtract(S& s, const S& before) const {
    std::visit([&](auto m) { s.*m -= before.*m; }, member_);
  }

 private:
  const char* name_;
  FieldKind kind_;
  Member member_;
  const char* metric_;
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

// The metrics `s` gives: each field that has a metric key, by that key.
using MetricValues = std::vector<std::pair<const char*, FieldValue>>;
template <class S>
void append_metrics(const FieldTable<S>& table, const S& s, MetricValues& out) {
  for (const auto& field : table) {
    if (field.metric() != nullptr) out.emplace_back(field.metric(), field.value(s));
  }
}

}  // namespace remat
