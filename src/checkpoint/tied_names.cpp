#include "checkpoint/tied_names.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "shardtorch/checkpoint/safetensors_error.h"

namespace shardtorch::checkpoint {

std::optional<TiedSource> tied_source(const std::vector<std::string>& names,
                                      const std::function<bool(const std::string&)>& held,
                                      const std::vector<std::string>& tied_from, const std::string& where,
                                      const char* option) {
  std::vector<std::string> present;
  for (const auto& n : names)
    if (held(n)) present.push_back(n);
  for (const auto& n : names)
    if (std::find(tied_from.begin(), tied_from.end(), n) != tied_from.end()) {
      if (!held(n))
        throw SafetensorsError(
            where + ": " + option + " takes '" + n + "', but the checkpoint does not hold it (it holds " +
            (present.empty() ? std::string("none of its names") : "'" + present.front() + "'") + ")");
      return TiedSource{n, {}};
    }
  if (present.empty()) return std::nullopt;
  TiedSource t{present.front(), {}};
  t.others.assign(present.begin() + 1, present.end());
  return t;
}

void check_tied_from(const ParameterNames& names, const std::vector<std::string>& tied_from, const std::string& where,
                     const char* option) {
  std::map<std::string, const std::vector<std::string>*> tie_of;
  for (const auto& [impl, ns] : names)
    if (ns.size() > 1)
      for (const auto& n : ns) tie_of[n] = &ns;
  std::set<const std::vector<std::string>*> chosen;
  for (const auto& n : tied_from) {
    auto it = tie_of.find(n);
    if (it == tie_of.end())
      throw SafetensorsError(where + ": " + option + " names '" + n +
                             "', which is no name of a tied parameter of the model");
    if (!chosen.insert(it->second).second) {
      std::string both;
      for (const auto& m : tied_from)
        if (tie_of.count(m) && tie_of.at(m) == it->second) both += (both.empty() ? "'" : " and '") + m + "'";
      throw SafetensorsError(where + ": " + option + " names " + both +
                             ", two names of one tied parameter: name the one to load from");
    }
  }
}

int64_t first_difference(const at::Tensor& a_in, const at::Tensor& b_in) {
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const size_t size = a.element_size();
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  if (std::memcmp(pa, pb, size * a.numel()) == 0) return -1;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (std::memcmp(pa + i * size, pb + i * size, size) != 0) return i;
  return -1;
}

void require_equal_tied(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype, const std::string& a_name,
                        const std::string& b_name, int64_t offset, const std::string& where, const char* option) {
  const int64_t at = first_difference(a.to(dtype).reshape({-1}), b.to(dtype).reshape({-1}));
  if (at < 0) return;
  throw SafetensorsError(where + ": '" + a_name + "' and '" + b_name +
                         "' are one tied parameter of the model, but the checkpoint holds different values under "
                         "them (the first at element " +
                         std::to_string(offset + at) + "); " + option + "({\"" + a_name + "\"}) loads it from '" +
                         a_name + "', " + option + "({\"" + b_name + "\"}) from '" + b_name + "'");
}

std::pair<int64_t, int64_t> share_of(int64_t numel, int rank, int ranks) {
  const int64_t chunk = (numel + std::max(ranks, 1) - 1) / std::max(ranks, 1);
  const int64_t first = std::min(numel, chunk * rank);
  return {first, std::min(numel, first + chunk) - first};
}

}  // namespace shardtorch::checkpoint
