#pragma once
// Command lines of the examples and tools (Boost.Program_options). Numbers:
// the whole text must be the number (no "12abc", no spaces), and a bad one
// names the option and the text. And how their main()s report an error.
#include <boost/program_options.hpp>
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

namespace po = boost::program_options;

// A numeric option: its text is parsed by parse<T> into `dst`, whose value
// now is the default (shown by --help).
template <typename T>
po::typed_value<std::string>* number_option(T& dst, const std::string& flag) {
  char shown[64];
  const auto [end, err] = std::to_chars(shown, shown + sizeof(shown), dst);  // shortest text that reads back as dst
  (void)err;
  return po::value<std::string>()
      ->default_value(std::string(shown, end))
      ->notifier([&dst, flag](const std::string& text) { dst = parse<T>(flag, text); });
}

// Parses argv by `desc`, which has a "help" switch, and stores the values.
// Returns false after printing `usage` and the options for --help.
inline bool parse_command_line(int argc, char** argv, const po::options_description& desc, const std::string& usage) {
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, desc), vm);
  if (vm.count("help")) {
    std::cout << usage << "\n" << desc << "\n";
    return false;
  }
  po::notify(vm);
  return true;
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

// The --strategy of an example that shards over `dp` data-parallel ranks:
// the one given, else full_shard, or no_shard over one rank (nothing to shard).
inline std::string strategy_or_default(const std::string& given, int dp) {
  if (!given.empty()) return given;
  return dp > 1 ? "full_shard" : "no_shard";
}

}  // namespace cli
