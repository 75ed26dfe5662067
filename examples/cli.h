#pragma once
// Numbers on the command lines of the examples and tools. The whole text must
// be the number (no "12abc", no spaces), and a bad one names the option and
// the text (std::stoi's own error says only "stoi"). And how their main()s
// report an error.
#include <c10/util/Exception.h>

#include <charconv>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace cli {

template <typename T>
std::optional<T> number(const std::string& text) {
  T v{};
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || err != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return v;
}

template <typename T>
T parse(const std::string& option, const std::string& text) {
  if (auto v = number<T>(text)) return *v;
  throw std::invalid_argument(option + " '" + text + "' is not " +
                              (std::is_integral_v<T> ? "a whole number" : "a number"));
}

// Inside a catch block: prints the exception being handled as
// "program: message" (a c10::Error without LibTorch's C++ stack trace) and
// returns main()'s exit status, 1.
inline int report_error(const char* program) {
  try {
    throw;
  } catch (const c10::Error& e) {
    std::cerr << program << ": " << e.what_without_backtrace() << "\n";
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
  } catch (...) {
    std::cerr << program << ": an exception that is not a std::exception\n";
  }
  return 1;
}

}  // namespace cli
