#include "runtime/json_schema.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

#include "runtime/error.h"

namespace remat::json_schema {
namespace {

std::string json_type_name(const json& value) {
  switch (value.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    case json::value_t::string: return "string";
    case json::value_t::array: return "array";
    case json::value_t::object: return "object";
    default: return "value";
  }
}

}  // namespace

std::string preview(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  return str(text.substr(0, limit), "... (", text.size(), " characters)");
}

std::string preview(const json& value, size_t limit) {
  if (value.is_number_float() && !std::isfinite(value.get<double>())) {
    const double d = value.get<double>();
    return std::isnan(d) ? "nan" : (d > 0 ? "inf" : "-inf");
  }
  if (value.is_string()) {
    return "\"" + preview(value.get_ref<const std::string&>(), limit) + "\"";
  }
  // Values reaching a message were parsed with at most kMaxDepth levels, so
  // dumping them is bounded in depth; their size is cut here.
  if ((value.is_array() || value.is_object()) && value.size() > 8) {
    return str(json_type_name(value), " of ", value.size(), value.is_array() ? " elements" : " keys");
  }
  return preview(value.dump(), limit);
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::kBool: return "boolean";
    case Kind::kInt: return "integer";
    case Kind::kNumber: return "number";
    case Kind::kNumberOrWord: return "number";
    case Kind::kString: return "string";
    case Kind::kStringList: return "array of strings";
    case Kind::kNumberPair: return "array of 2 numbers";
    case Kind::kObject: return "object";
  }
  return "?";
}

Field refused(const char* name, std::function<std::string(const std::string& path, const json& value)> message,
              std::function<bool(const json& value, const json& section)> asks_nothing) {
  Field field;
  field.name = name;
  field.kind = Kind::kObject;  // never read: the key's value is only asked whether it asks for nothing
  field.refusal = std::move(message);
  field.asks_nothing = std::move(asks_nothing);
  return field;
}

// DeepSpeed's way of writing a feature off ({"enabled": false, ...}, an
// offload with {"device": "none"}), as copied configs carry it. Anything else
// (true, "auto", other values) asks for something.
bool switched_off(const json& value) {
  if (!value.is_object()) return false;
  auto enabled = value.find("enabled");
  if (enabled != value.end()) return enabled->is_boolean() && !enabled->get<bool>();
  auto device = value.find("device");
  return device != value.end() && device->is_string() && device->get<std::string>() == "none";
}

Field inline_section(const char* name, std::vector<Field> children) {
  Field field;
  field.name = name;
  field.kind = Kind::kObject;
  field.children = std::move(children);
  field.member = [](void* target) { return target; };
  field.member_const = [](const void* target) { return target; };
  return field;
}


namespace {

std::string lowered(const std::string& s) {
  std::string out = s;
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// Edits between a and b: insertions, deletions, substitutions and swaps of
// two adjacent characters (modle -> model is one).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1,
                          d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

// The option `name` was probably meant to be, or "" when none is really
// close: case is ignored, and at most one edit per four characters of `name`
// beyond the first (at most three) is allowed, or `name` (three characters
// or more) begins the option. A suggestion that is far off ("fp16" for
// "bf16", "zero_optimization" for "wall_clock_breakdown") misleads more than
// none.
std::string closest(const std::string& name, const std::vector<std::string>& options) {
  // Edit distance is quadratic: a name far longer than any option is like none of them.
  if (name.size() > 100 || name.empty()) return "";
  const std::string low = lowered(name);
  const size_t limit = std::min<size_t>(3, (name.size() - 1) / 4);
  std::string best;
  size_t best_distance = SIZE_MAX;
  for (const auto& option : options) {
    const std::string candidate = lowered(option);
    size_t d = edit_distance(low, candidate);
    if (d > limit && !(low.size() >= 3 && candidate.compare(0, low.size(), low) == 0)) continue;
    if (d < best_distance) {
      best_distance = d;
      best = option;
    }
  }
  return best;
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : ", ") + item;
  return out;
}

std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// The keys a section accepts (refused ones are not offered).
std::vector<std::string> names_of(const std::vector<Field>& fields) {
  std::vector<std::string> names;
  for (const auto& f : fields) {
    if (!f.refusal) names.push_back(f.name);
  }
  return names;
}

}  // namespace

[[noreturn]] void fail(const std::string& source, const std::string& message) {
  throw ConfigError("config error in " + source + ": " + message);
}

namespace {

std::string where(const std::string& path) {
  return path.empty() ? "at the top level" : "in '" + path + "'";
}

// "unknown key 'a.b'", with "; did you mean 'a.c'?" when a valid key is close.
std::string unknown_key(const std::string& path, const std::string& name, const std::vector<Field>& fields) {
  const std::string prefix = path.empty() ? "" : path + ".";
  const std::string near = closest(name, names_of(fields));
  return str("unknown key '", prefix, preview(name), "'",
             near.empty() ? std::string() : "; did you mean '" + prefix + near + "'?");
}

std::string valid_keys(const std::string& path, const std::vector<Field>& fields) {
  return str("Valid keys ", where(path), ": ", join(names_of(fields)));
}

// One unknown key, with the valid keys of its section.
std::string unknown_key_message(const std::string& path, const std::string& name,
                                const std::vector<Field>& fields) {
  const std::string line = unknown_key(path, name, fields);
  return line + (line.back() == '?' ? " " : ". ") + valid_keys(path, fields);
}

// Whether `value` has the JSON type `field` takes (a whole number for an
// integer, one of the words for a number-or-word); ranges and choices are
// checked after.
// A number-or-word bound to an integer (its range set) takes whole numbers.
bool integral(const Field& field) { return field.kind == Kind::kInt || field.max_value > field.min_value; }

bool whole_number(const json& value) {
  return value.is_number_integer() ||
         (value.is_number_float() && std::trunc(value.get<double>()) == value.get<double>());
}

bool is_auto(const json& value) { return value.is_string() && value.get_ref<const std::string&>() == "auto"; }

bool has_kind(const Field& field, const json& value) {
  switch (field.kind) {
    case Kind::kBool: return value.is_boolean();
    case Kind::kInt: return whole_number(value);
    case Kind::kNumber: return value.is_number();
    case Kind::kNumberOrWord:
      return (value.is_number() && (!integral(field) || whole_number(value))) ||
             (value.is_string() && std::find(field.choices.begin(), field.choices.end(),
                                             value.get_ref<const std::string&>()) != field.choices.end());
    case Kind::kString: return value.is_string();
    case Kind::kStringList:
      return value.is_array() &&
             std::all_of(value.begin(), value.end(),
                         [](const json& v) { return v.is_string(); });
    case Kind::kNumberPair:
      return value.is_array() && value.size() == 2 && value[0].is_number() &&
             value[1].is_number();
    case Kind::kObject: return value.is_object();
  }
  return false;
}

// `typed`: the text an override gave, quoted in messages instead of the
// parsed value (99999999999999999999 rather than 1e+20).
// What is wrong with `value` for `field` at `path`, or "" when nothing is.
std::string type_problem(const std::string& path, const Field& field, const json& value,
                         const std::string* typed = nullptr) {
  auto shown = [&] { return typed != nullptr && !value.is_string() ? preview(*typed) : preview(value); };
  if (value.is_null() && field.nullable) return "";
  if (field.auto_ok && is_auto(value)) return "";
  // 1e999 parses as infinity: refused by name before any range or conversion.
  auto finite = [](const json& v) { return !v.is_number_float() || std::isfinite(v.get<double>()); };
  if (!finite(value) ||
      (value.is_array() && !std::all_of(value.begin(), value.end(), finite))) {
    return str("'", path, "' = ", shown(), " is not a finite number");
  }
  if (!has_kind(field, value)) {
    // Launchers that fill values in (Hugging Face's Trainer) write "auto".
    const bool auto_value = is_auto(value);
    std::string words;  // kNumberOrWord: the strings it takes, and the closest to the one given
    if (field.kind == Kind::kNumberOrWord) {
      for (const auto& w : field.choices) words += " or \"" + w + "\"";
      const std::string near = value.is_string() ? closest(value.get_ref<const std::string&>(), field.choices) : "";
      if (!near.empty()) return str("'", path, "' = ", shown(), " is neither a number nor", words.substr(3),
                                    "; did you mean \"", near, "\"?");
    }
    // null: the type says it all ("got null null" says it twice); it does not mean "the default".
    const std::string got = value.is_null() ? std::string("null (leave the key out to keep its default)")
                                            : json_type_name(value) + " " + shown();
    // "Auto", " auto ": the word where the key takes it, misspelt.
    const bool near_auto = field.auto_ok && value.is_string() && !auto_value && [&] {
      std::string w;
      for (char ch : value.get_ref<const std::string&>()) {
        if (ch != ' ') w += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
      }
      return w == "auto";
    }();
    return str("'", path, "' must be ", integral(field) ? "integer" : kind_name(field.kind), words, field.nullable ? " or null" : "", ", got ",
               got, near_auto ? "; did you mean \"auto\" (remat decides it)?" : "",
               auto_value ? std::string(" (\"auto\" is filled in by a launcher such as Hugging Face's "
                                        "Trainer; remat decides \"auto\" only for the keys docs/config.md lists "
                                        "under \"auto\", and this is not one of them: give a value or leave the "
                                        "key out)")
                          : std::string());
  }
  if (integral(field) && value.is_number()) {
    // Compared as they were parsed (no conversion that could overflow first).
    bool in_range;
    if (value.is_number_unsigned()) {
      in_range = static_cast<double>(value.get<uint64_t>()) <= field.max_value;
    } else if (value.is_number_integer()) {
      const double v = static_cast<double>(value.get<int64_t>());
      in_range = v >= field.min_value && v <= field.max_value;
    } else {
      const double v = value.get<double>();
      in_range = v >= field.min_value && v <= field.max_value;
    }
    if (!in_range) {
      return str("'", path, "' = ", shown(), " is out of range: it must be an integer from ",
                 static_cast<int64_t>(field.min_value), " to ", static_cast<int64_t>(field.max_value));
    }
  }
  if (!field.choices.empty() && field.kind != Kind::kNumberOrWord) {
    const auto& s = value.get_ref<const std::string&>();
    if (std::find(field.choices.begin(), field.choices.end(), s) == field.choices.end()) {
      const std::string near = closest(s, field.choices);
      return str("'", path, "' = ", shown(), " is not one of ", join(field.choices),
                 near.empty() ? std::string() : "; did you mean \"" + near + "\"?");
    }
  }
  return "";
}

void check_type(const std::string& source, const std::string& path, const Field& field,
                const json& value, const std::string* typed = nullptr) {
  const std::string problem = type_problem(path, field, value, typed);
  if (!problem.empty()) fail(source, problem);
}

// What is wrong in a document: the first kListed problems in words (a
// document of thousands of stray keys gets a message of bounded size, in
// bounded time), all of them counted, and the sections with unknown keys.
struct Problems {
  static constexpr size_t kListed = 30;
  std::vector<std::string> listed;
  size_t total = 0;
  std::vector<std::pair<std::string, const std::vector<Field>*>> sections;
  bool listing() const { return listed.size() < kListed; }
  void add(std::string problem) {
    ++total;
    if (listing()) listed.push_back(std::move(problem));
  }
};

// Whether the refused key `field`, given `value` in `section` (at `path`),
// asks for nothing: accepted and ignored. A section of the document that
// switches itself off asks for nothing whatever else it holds.
bool asks_nothing(const Field& field, const json& value, const json& section, const std::string& path) {
  if (!path.empty() && switched_off(section)) return true;
  return field.asks_nothing ? field.asks_nothing(value, section) : switched_off(value);
}

// What is wrong with a value of the right type (value_refusal), or "".
std::string value_problem(const std::string& path, const Field& field, const json& value) {
  if (!field.value_refusal || is_auto(value) || value.is_null()) return "";
  return field.value_refusal(path, value);
}

// Spellings of one key (Field::spelling_of) given together in `object`.
void collect_spellings(const std::string& path, const std::vector<Field>& fields, const json& object,
                       Problems& problems) {
  std::map<std::string, std::vector<std::string>> given;  // preferred spelling -> those given, in key order
  for (const auto& [name, value] : object.items()) {
    auto it = std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.name == name; });
    if (it != fields.end() && !it->refusal) given[it->spelling_of.empty() ? name : it->spelling_of].push_back(name);
  }
  for (const auto& [preferred, names] : given) {
    if (names.size() < 2) continue;
    std::string listed;
    for (size_t i = 0; i < names.size(); ++i) {
      listed += str(i == 0 ? "" : i + 1 == names.size() ? " and " : ", ", "'", join_path(path, names[i]), "' (",
                    preview(object.at(names[i])), ")");
    }
    const bool has_preferred = std::find(names.begin(), names.end(), preferred) != names.end();
    problems.add(str(listed, " are spellings of one key, given together: only one value could be read; keep ",
                     has_preferred ? "'" : "one, preferably '", join_path(path, preferred), "', and remove the ",
                     names.size() > 2 ? "others" : "other"));
  }
}

// Every unknown key, refused key, wrong type and key given in two spellings
// in `object` and in the sections it holds.
void collect_problems(const std::string& path, const std::vector<Field>& fields, const json& object,
                      Problems& problems) {
  for (const auto& [name, value] : object.items()) {
    auto it = std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.name == name; });
    const std::string child_path = join_path(path, name);
    if (it == fields.end()) {
      problems.add(problems.listing() ? unknown_key(path, name, fields) : std::string());
      auto& sections = problems.sections;
      if (std::none_of(sections.begin(), sections.end(), [&](const auto& s) { return s.first == path; })) {
        sections.emplace_back(path, &fields);
      }
    } else if (it->refusal) {
      if (!asks_nothing(*it, value, object, path)) problems.add(it->refusal(child_path, value));
    } else if (std::string problem = type_problem(child_path, *it, value); !problem.empty()) {
      problems.add(std::move(problem));
    } else if (std::string refused_value = value_problem(child_path, *it, value); !refused_value.empty()) {
      problems.add(std::move(refused_value));
    } else if (it->kind == Kind::kObject) {
      collect_problems(child_path, it->children, value, problems);
    }
  }
  collect_spellings(path, fields, object, problems);
}

// Fails when `object` has any problem: one alone as it is, several as a list
// followed by the valid keys of each section with unknown ones.
void check_object(const std::string& source, const std::string& path, const std::vector<Field>& fields,
                  const json& object) {
  Problems problems;
  collect_problems(path, fields, object, problems);
  if (problems.total == 0) return;
  const auto& sections = problems.sections;
  if (problems.total == 1) {
    const std::string& only = problems.listed.front();
    if (sections.empty()) fail(source, only);
    fail(source, only + (only.back() == '?' ? " " : ". ") + valid_keys(sections[0].first, *sections[0].second));
  }
  std::string message = str(problems.total, " problems (nothing was applied):");
  for (const auto& p : problems.listed) message += "\n  - " + p;
  if (problems.total > problems.listed.size()) {
    message += str("\n  - ... and ", problems.total - problems.listed.size(), " more");
  }
  for (const auto& [section, section_fields] : sections) message += "\n  " + valid_keys(section, *section_fields);
  fail(source, message);
}

// Stores every value of `object` (validated by check_object) into `target`;
// "auto" where it is taken is reported in `auto_keys` instead.
void assign(const std::string& path, const std::vector<Field>& fields, const json& object, void* target,
            std::vector<std::string>* auto_keys) {
  for (const auto& [name, value] : object.items()) {
    auto it = std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.name == name; });
    if (it == fields.end() || it->refusal) continue;
    if (it->kind == Kind::kObject) {
      assign(join_path(path, name), it->children, value, it->member(target), auto_keys);
    } else if (it->auto_ok && is_auto(value)) {
      if (auto_keys != nullptr) auto_keys->push_back(join_path(path, name));
    } else {
      it->assign(value, target);
    }
  }
}


}  // namespace

// Validates all of `object` against `fields`, then stores every present value.
void apply(const std::string& source, const std::string& path,
           const std::vector<Field>& fields, const json& object, void* target, std::vector<std::string>* auto_keys) {
  check_object(source, path, fields, object);
  assign(path, fields, object, target, auto_keys);
}

void allow_auto(std::vector<Field>& fields, const std::string& path) {
  const auto dot = path.find('.');
  const std::string head = path.substr(0, dot);
  auto it = std::find_if(fields.begin(), fields.end(), [&](const Field& f) { return f.name == head; });
  REMAT_CHECK(it != fields.end() && !it->refusal, "allow_auto: the schema has no key '", head, "' (in '", path, "')");
  if (dot == std::string::npos) {
    REMAT_CHECK(it->kind != Kind::kObject, "allow_auto: '", path, "' is a section, not a key");
    it->auto_ok = true;
  } else {
    REMAT_CHECK(it->kind == Kind::kObject, "allow_auto: '", head, "' is not a section (in '", path, "')");
    allow_auto(it->children, path.substr(dot + 1));
  }
}

json dump(const std::string& path, const std::vector<Field>& fields, const void* target) {
  json out = json::object();
  for (const auto& field : fields) {
    if (field.refusal || !field.spelling_of.empty()) continue;  // other spellings: the preferred one holds the value
    std::string child_path = join_path(path, field.name);
    if (field.kind == Kind::kObject) {
      out[field.name] = dump(child_path, field.children, field.member_const(target));
    } else {
      out[field.name] = field.dump(target);
    }
  }
  return out;
}

namespace {

// Parses with the nesting bounded and duplicate keys found (JSON parsers
// otherwise keep the last silently). Throws json::parse_error for malformed
// text, ConfigError (via fail) for the rest.
// `at`: the key the text is the value of (an override's), "" for a document.
json parse_bounded(const std::string& text, const std::string& source, const std::string& at = "") {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  std::vector<std::string> keys;  // the path to the value being parsed
  json::parser_callback_t callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if ((event == json::parse_event_t::object_start || event == json::parse_event_t::array_start) &&
        depth >= kMaxDepth) {
      fail(source, str("values are nested deeper than ", kMaxDepth,
                       " levels; remat's configuration is at most 3 levels deep"));
    }
    if (event == json::parse_event_t::object_start) {
      open_objects.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      if (!open_objects.empty()) open_objects.pop_back();
    } else if (event == json::parse_event_t::key && !open_objects.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!open_objects.back().insert(key).second && duplicate.empty()) duplicate = key;
      keys.resize(static_cast<size_t>(std::max(depth, 1)));
      keys.back() = key;
    }
    return true;
  };
  json value;
  try {
    value = json::parse(text, callback);
  } catch (const json::out_of_range& e) {
    // A number beyond double's range (1e999): named by its key.
    std::string path = at;
    for (const auto& k : keys) path = join_path(path, k);
    std::string what = e.what();
    const auto quote = what.find('\'');
    fail(source, str(path.empty() ? std::string("a value") : "'" + path + "'", " holds a number beyond ",
                     "what a double holds (about 1.8e308)",
                     quote == std::string::npos ? std::string() : ": " + preview(what.substr(quote))));
  }
  if (!duplicate.empty()) {
    fail(source, str("key '", preview(duplicate), "' appears twice in one object; keep one of them"));
  }
  return value;
}

}  // namespace

json parse_strict(const std::string& text, const std::string& source) {
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    const size_t line = 1 + std::count(text.begin(), text.begin() + nul, '\n');
    fail(source, str("a NUL byte at line ", line, " (byte ", nul,
                     "): a config is JSON text; the file may be binary or truncated"));
  }
  json value;
  try {
    value = parse_bounded(text, source);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    auto bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    fail(source, "malformed JSON: " + preview(what, 200));
  }
  if (!value.is_object()) {
    fail(source, str("the top level must be a JSON object, got ", json_type_name(value)));
  }
  return value;
}

namespace {

// Finds the field a dotted path names, or fails with the closest valid key.
const Field& find_field(const std::vector<Field>& schema, const std::string& source,
                        const std::string& dotted) {
  // getline drops a trailing empty part: model.n_layer.=2 would set model.n_layer.
  if (dotted.empty()) fail(source, "an empty key cannot be set");
  if (dotted.front() == '.' || dotted.back() == '.' || dotted.find("..") != std::string::npos) {
    fail(source, str("'", preview(dotted), "' has an empty key part (a leading, trailing or doubled '.'): "
                     "a key path is key names joined by single dots, e.g. model.n_layer=8"));
  }
  const std::vector<Field>* fields = &schema;
  const Field* found = nullptr;
  std::string path;
  std::stringstream parts(dotted);
  std::string part;
  while (std::getline(parts, part, '.')) {
    // A refused key is looked into no further (set whole, its value decides: apply_override).
    if (found != nullptr && found->refusal) fail(source, found->refusal(path, json(json::value_t::discarded)));
    if (found != nullptr && found->kind != Kind::kObject) {
      fail(source, str("'", path, "' is a ", kind_name(found->kind),
                       ", not a section: '", dotted, "' cannot be set"));
    }
    if (found != nullptr) fields = &found->children;
    auto it = std::find_if(fields->begin(), fields->end(),
                           [&](const Field& f) { return f.name == part; });
    if (it == fields->end()) fail(source, unknown_key_message(path, part, *fields));
    found = &*it;
    path = join_path(path, part);
  }
  if (found == nullptr) fail(source, "an empty key cannot be set");
  return *found;
}

// The object of `root` that holds the last of `keys` (an empty one where there is none).
json section_at(const json& root, const std::vector<std::string>& keys) {
  const json* node = &root;
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    auto it = node->find(keys[i]);
    if (it == node->end() || !it->is_object()) return json::object();
    node = &*it;
  }
  return *node;
}

// Writes the keys of `patch` into `target`, section into section: what
// `patch` leaves out keeps its value.
void merge_into(json& target, const json& patch) {
  for (const auto& [key, value] : patch.items()) {
    json& slot = target[key];
    if (slot.is_object() && value.is_object()) {
      merge_into(slot, value);
    } else {
      slot = value;
    }
  }
}

}  // namespace

std::string override_source(const std::string& text) {
  // Whole up to a size a typed override has, so that no number is cut short.
  constexpr size_t kWhole = 200;
  if (text.size() <= kWhole) return "--set " + text;
  const auto eq = text.find('=');
  if (eq == std::string::npos) return "--set " + preview(text, kWhole);
  return str("--set ", preview(text.substr(0, eq), 100), "=", preview(text.substr(eq + 1), 100));
}

void apply_override(json& root, const std::vector<Field>& schema, const std::string& text) {
  const std::string source = override_source(text);
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    fail(source, "overrides are written key.path=value, e.g. model.n_layer=8");
  }
  std::string dotted = text.substr(0, eq);
  std::string raw = text.substr(eq + 1);
  const Field& field = find_field(schema, source, dotted);
  json value;
  try {
    value = parse_bounded(raw, source, dotted);
  } catch (const json::parse_error&) {
    value = raw;  // A bare word is a string: optimizer.type=SGD.
  }
  std::stringstream parts(dotted);
  std::string part;
  std::vector<std::string> keys;
  while (std::getline(parts, part, '.')) keys.push_back(part);
  if (field.refusal) {
    // Its "off" value is accepted (and ignored), as in a file.
    const std::string parent = dotted.substr(0, dotted.size() - std::min(dotted.size(), keys.back().size() + 1));
    if (!asks_nothing(field, value, section_at(root, keys), parent)) fail(source, field.refusal(dotted, value));
  } else {
    // A string field keeps what was typed even when it parses as JSON (data.path=1).
    if (field.kind == Kind::kString && !value.is_string()) value = raw;
    // Checked here as well, so that messages quote the value as it was typed.
    // (A section must be given an object, so later overrides can walk into it.)
    check_type(source, dotted, field, value, &raw);
    if (const std::string problem = value_problem(dotted, field, value); !problem.empty()) fail(source, problem);
    // A whole section (model={"n_layer": 2}) is checked here too, so that its
    // errors name this override.
    if (field.kind == Kind::kObject) check_object(source, dotted, field.children, value);
  }
  json* node = &root;
  for (size_t i = 0; i + 1 < keys.size(); ++i) {
    json& next = (*node)[keys[i]];
    if (next.is_null()) next = json::object();
    if (!next.is_object()) fail(source, str("'", keys[i], "' is not an object: '", dotted, "' cannot be set"));
    node = &next;
  }
  json& slot = (*node)[keys.back()];
  if (field.kind == Kind::kObject && slot.is_object()) {
    merge_into(slot, value);
  } else {
    slot = value;
  }
}


std::string closest_choice(const std::string& name, const std::vector<std::string>& options) {
  return closest(name, options);
}

}  // namespace remat::json_schema
