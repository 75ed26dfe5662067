// The warnings a scope raised (TORCH_WARN), for tests that check them.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace testmodels {

/// Install with c10::WarningUtils::WarningHandlerGuard guard(&captured).
struct CapturedWarnings : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  /// Whether a message holds `text`.
  bool any_with(const std::string& text) const {
    for (const auto& m : messages)
      if (m.find(text) != std::string::npos) return true;
    return false;
  }
};

}  // namespace testmodels
