// flexdemo/names.h — one name table per enum: the words the command line, config files and JSON
// use for its values, and the conversions both ways. An enum takes part by specialising
// NameTable next to its declaration; nothing else spells those words.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace flexdemo {

// Specialise as
//   template <> struct NameTable<E> {
//     static constexpr const char* what = "value encoding";          // for error messages
//     static constexpr std::pair<E, const char*> entries[] = {{E::A, "a"}, ...};
//   };
template <class E>
struct NameTable;

// The accepted words, in table order.
template <class E>
std::vector<std::string> names_of() {
  std::vector<std::string> names;
  for (const auto& entry : NameTable<E>::entries) names.push_back(entry.second);
  return names;
}

// Every value, in table order (tests run each of them).
template <class E>
std::vector<E> values_of() {
  std::vector<E> values;
  for (const auto& entry : NameTable<E>::entries) values.push_back(entry.first);
  return values;
}

template <class E>
std::string name_of(E value) {
  for (const auto& entry : NameTable<E>::entries) {
    if (entry.first == value) return entry.second;
  }
  return "unknown";
}

// Throws std::invalid_argument "unknown WHAT 'name'; accepted: a, b, c".
template <class E>
E parse_name(const std::string& name) {
  std::string accepted;
  for (const auto& entry : NameTable<E>::entries) {
    if (name == entry.second) return entry.first;
    accepted += (accepted.empty() ? "" : ", ") + std::string(entry.second);
  }
  throw std::invalid_argument("unknown " + std::string(NameTable<E>::what) + " '" + name +
                              "'; accepted: " + accepted);
}

}  // namespace flexdemo
