// A strict JSON-to-struct engine: a table of fields, each bound to a struct
// member, validates a JSON document (every unknown key, with a valid key only
// when one is really close; keys the schema recognises but refuses, with its
// reason, unless at a value that asks for nothing; values it refuses; wrong
// types with path, expected and actual type; a key given in two of its
// spellings: all of them in one error; duplicate keys, malformed JSON with
// line and column), fills the structs, applies "a.b.c=value" overrides and
// dumps the structs back. It knows no schema: engine/config.cc holds remat's.
//
//   struct Section { int size = 1; };
//   struct Root { Section section; };
//   const std::vector<json_schema::Field> fields = {
//       json_schema::object("section", &Root::section,
//                           {json_schema::leaf("size", &Section::size)})};
//   Root root;
//   json_schema::apply("my.json", "", fields, json_schema::parse_strict(text, "my.json"), &root);
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace remat::json_schema {

using nlohmann::json;

// kNumberOrWord: a number, or one of the field's `choices` in its place.
enum class Kind { kBool, kInt, kNumber, kNumberOrWord, kString, kStringList, kNumberPair, kObject };

const char* kind_name(Kind kind);

struct Field {
  std::string name;
  Kind kind;
  bool nullable = false;
  // kInt, and kNumberOrWord bound to an integer: the range of the member's
  // type (values outside it are refused before any conversion); both 0 otherwise.
  double min_value = 0, max_value = 0;
  std::vector<std::string> choices;  // allowed strings, when not empty
  std::vector<Field> children;       // kObject
  // Leaves: store a validated value into / read it from the enclosing struct.
  std::function<void(const json&, void*)> assign;
  std::function<json(const void*)> dump;
  // Objects: the member struct inside the enclosing struct.
  std::function<void*(void*)> member;
  std::function<const void*(const void*)> member_const;
  // Set for a key the schema recognises but does not accept (refused()): the
  // message for the key at `path` given `value`, saying why and what to do
  // instead.
  std::function<std::string(const std::string& path, const json& value)> refusal;
  // With `refusal`: whether `value` asks for nothing (the key's "off" value),
  // given the object `section` that holds the key; such a value is accepted
  // and ignored. Unset: a section that switches itself off (see refused()).
  std::function<bool(const json& value, const json& section)> asks_nothing;
  // A value of the field's type that asks for what the schema's owner does
  // not do: the problem, or "" for a value it takes. Checked with the types,
  // so that such values are listed in the same error as the other problems.
  std::function<std::string(const std::string& path, const json& value)> value_refusal;
  // Another spelling of the key named here (its preferred spelling): two
  // spellings of one key given in one object are refused, naming both, since
  // only one of the values could be read.
  std::string spelling_of;
  // Takes the string "auto" in place of a value (allow_auto()): the member
  // keeps what it holds and apply() reports the key, for its caller to decide.
  bool auto_ok = false;
};

template <typename T>
struct KindOf;
template <> struct KindOf<bool> { static constexpr Kind value = Kind::kBool; };
template <> struct KindOf<int> { static constexpr Kind value = Kind::kInt; };
template <> struct KindOf<int64_t> { static constexpr Kind value = Kind::kInt; };
template <> struct KindOf<double> { static constexpr Kind value = Kind::kNumber; };
template <> struct KindOf<std::string> { static constexpr Kind value = Kind::kString; };
template <> struct KindOf<std::vector<std::string>> { static constexpr Kind value = Kind::kStringList; };
template <> struct KindOf<std::array<double, 2>> { static constexpr Kind value = Kind::kNumberPair; };

// The deepest nesting a document (or an override's value) may have: remat's
// schema is three levels deep, and deeper input is refused before anything
// walks it recursively.
constexpr int kMaxDepth = 16;

// At most `limit` characters of a value for a message (long strings and
// large arrays or objects are cut, with what was left out said).
std::string preview(const json& value, size_t limit = 60);
std::string preview(const std::string& text, size_t limit = 60);

template <typename T>
void set_range(Field& field) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // int64 members stop at 2^53, where doubles (DeepSpeed's 5e8) still count exactly.
    constexpr double kExact = 9007199254740992.0;
    field.min_value = std::max(static_cast<double>(std::numeric_limits<T>::min()), -kExact);
    field.max_value = std::min(static_cast<double>(std::numeric_limits<T>::max()), kExact);
  }
}

template <typename T>
T convert(const json& value) {
  if constexpr (std::is_same_v<T, int> || std::is_same_v<T, int64_t>) {
    // DeepSpeed configs write sizes as 5e8: integral floats count as integers.
    return static_cast<T>(value.get<double>());
  } else {
    return value.get<T>();
  }
}

template <typename S, typename T>
Field leaf(const char* name, T S::*member, std::vector<std::string> choices = {}) {
  Field field;
  field.name = name;
  field.choices = std::move(choices);
  field.assign = [member](const json& value, void* target) {
    static_cast<S*>(target)->*member = convert<T>(value);
  };
  field.dump = [member](const void* target) {
    return json(static_cast<const S*>(target)->*member);
  };
  field.kind = KindOf<T>::value;
  set_range<T>(field);
  return field;
}

// A string key bound to an enum member: `names[i]` is the name of the
// enumerator whose value is i (enumerators numbered 0, 1, ...). Any other
// string is refused, listing the names (with the closest one).
template <typename S, typename E>
Field enum_leaf(const char* name, E S::*member, const std::vector<std::string>& names) {
  static_assert(std::is_enum_v<E>, "enum_leaf binds an enum member");
  Field field;
  field.name = name;
  field.kind = Kind::kString;
  field.choices = names;
  // Values reach assign validated against `choices`, so the name is found.
  field.assign = [member, names](const json& value, void* target) {
    const auto& text = value.get_ref<const std::string&>();
    const auto at = std::find(names.begin(), names.end(), text) - names.begin();
    static_cast<S*>(target)->*member = static_cast<E>(at);
  };
  field.dump = [member, names](const void* target) {
    const auto i = static_cast<size_t>(static_cast<const S*>(target)->*member);
    return i < names.size() ? json(names[i]) : json(nullptr);
  };
  return field;
}

template <typename S, typename T>
Field optional_leaf(const char* name, std::optional<T> S::*member) {
  Field field;
  field.name = name;
  field.kind = KindOf<T>::value;
  set_range<T>(field);
  field.nullable = true;
  field.assign = [member](const json& value, void* target) {
    auto& slot = static_cast<S*>(target)->*member;
    if (value.is_null()) {
      slot.reset();
    } else {
      slot = convert<T>(value);
    }
  };
  field.dump = [member](const void* target) {
    const auto& slot = static_cast<const S*>(target)->*member;
    return slot ? json(*slot) : json(nullptr);
  };
  return field;
}

// A number key that also takes the string `word` in place of a number (as
// "knee" for a fraction, "auto" for a budget): bound to an optional number
// (double, or an integer type: then only whole numbers in its range) and a
// flag, at most one of them set; null clears both. Any other string is
// refused, naming `word`.
// (N is named, not deduced: the members may be a base class's of S.)
template <typename S, typename N = double>
Field number_or_word(const char* name, std::optional<std::common_type_t<N>> S::*number, bool S::*flag,
                     const char* word) {
  Field field;
  field.name = name;
  field.kind = Kind::kNumberOrWord;
  field.nullable = true;
  field.choices = {word};
  set_range<N>(field);
  field.assign = [number, flag](const json& value, void* target) {
    auto& s = *static_cast<S*>(target);
    s.*number = value.is_number() ? std::optional<N>(convert<N>(value)) : std::nullopt;
    s.*flag = value.is_string();  // validated: the word
  };
  field.dump = [number, flag, w = std::string(word)](const void* target) {
    const auto& s = *static_cast<const S*>(target);
    return s.*flag ? json(w) : (s.*number ? json(*(s.*number)) : json(nullptr));
  };
  return field;
}

template <typename S, typename M>
Field object(const char* name, M S::*member, std::vector<Field> children) {
  Field field;
  field.name = name;
  field.kind = Kind::kObject;
  field.children = std::move(children);
  field.member = [member](void* target) -> void* {
    return &(static_cast<S*>(target)->*member);
  };
  field.member_const = [member](const void* target) -> const void* {
    return &(static_cast<const S*>(target)->*member);
  };
  return field;
}

// A nested section whose keys belong to the enclosing struct (DeepSpeed's
// optimizer.params and scheduler.params).
Field inline_section(const char* name, std::vector<Field> children);

// A key that is recognised but refused: `message(path, value)` is the error
// (why, and what to do). A value for which `asks_nothing(value, section)`
// holds is accepted and ignored (the key's "off" value: DeepSpeed's
// zero_quantized_weights false); without `asks_nothing`, a section that
// switches itself off ({"enabled": false} or {"device": "none"}) is. Inside
// a section that switches itself off every refused key is accepted and
// ignored. Any other value is refused. It is neither dumped nor offered as
// a valid key.
Field refused(const char* name, std::function<std::string(const std::string& path, const json& value)> message,
              std::function<bool(const json& value, const json& section)> asks_nothing = {});

// Whether `value` is a section that switches itself off: {"enabled": false,
// ...}, or an offload's {"device": "none", ...}.
bool switched_off(const json& value);

// Lets the leaf at dotted `path` in `fields` (inline sections count as a
// part) take "auto" (Field::auto_ok). A path naming no leaf is an Error: the
// schema's own fault.
void allow_auto(std::vector<Field>& fields, const std::string& path);

// Throws ConfigError "config error in <source>: <message>".
[[noreturn]] void fail(const std::string& source, const std::string& message);

// Parses `text`, refusing NUL bytes, nesting deeper than kMaxDepth, duplicate
// keys and a top level that is not an object.
json parse_strict(const std::string& text, const std::string& source);

// Validates `object` against `fields` (at dotted `path`) and stores every
// present value into `target`, the struct the fields are bound to. Every
// unknown key, refused key or value, wrong type and key given in two
// spellings in `object` is listed in one ConfigError, and then nothing is
// stored. A key given "auto" where its field
// takes it (allow_auto) stores nothing: its dotted path is appended to
// `auto_keys` (when not null), in key order.
void apply(const std::string& source, const std::string& path, const std::vector<Field>& fields,
           const json& object, void* target, std::vector<std::string>* auto_keys = nullptr);

// The struct as JSON, every field present (a key with several spellings in
// its preferred one).
json dump(const std::string& path, const std::vector<Field>& fields, const void* target);

// Applies "a.b.c=value" to the document `root` (value is JSON, else a plain
// string); an unknown key fails (with a valid one when one is close), as does
// a refused one (at a value that asks for something) or a refused value, and
// a key path with an empty part ("model.n_layer."). A
// section given whole (model={"n_layer": 2}) is merged into what `root` holds
// there: the keys it leaves out keep their values, as with a key at a time.
// Errors name override_source(text) as their source.
void apply_override(json& root, const std::vector<Field>& fields, const std::string& text);

// "--set a.b.c=value" for messages: the override whole as typed (a number is
// never cut short), only a very long one cut.
std::string override_source(const std::string& text);

// The option `name` was probably meant to be (case ignored, a few edits, or
// a prefix), or "" when none is really close: what an error about a word
// offers in its place.
std::string closest_choice(const std::string& name, const std::vector<std::string>& options);

}  // namespace remat::json_schema
