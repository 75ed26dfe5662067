#pragma once
// Internal: which of a tied parameter's names a load reads, when a checkpoint
// holds it under several (docs/checkpoints.md, "Tied parameters"), and the
// comparison of the values held under the others.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shardtorch::checkpoint {

/// The model's parameters by TensorImpl, each with its names (detail::parameter_names).
using ParameterNames = std::map<const void*, std::vector<std::string>>;

/// The names a parameter is read from: `source`, and the `others` the
/// checkpoint also holds it under, whose values must equal `source`'s
/// (none when the tied_from option chose the source).
struct TiedSource {
  std::string source;
  std::vector<std::string> others;
};

/// For a parameter with `names` (the model's, first first): nullopt when the
/// checkpoint holds none of them (`held`); else the name listed in
/// `tied_from`, which must be held, or the first held. `where` starts errors
/// ("safetensors file 'F'"), `option` names the option ("LoadOptions().tied_from").
std::optional<TiedSource> tied_source(const std::vector<std::string>& names,
                                      const std::function<bool(const std::string&)>& held,
                                      const std::vector<std::string>& tied_from, const std::string& where,
                                      const char* option);

/// Every name of `tied_from` is a name of a tied parameter of the model,
/// one per parameter at most; throws SafetensorsError otherwise.
void check_tied_from(const ParameterNames& names, const std::vector<std::string>& tied_from, const std::string& where,
                     const char* option);

/// The first element where `a` and `b` (same dtype and size) differ
/// bitwise, -1 when none does.
int64_t first_difference(const at::Tensor& a, const at::Tensor& b);

/// Throws SafetensorsError when `a` and `b`, read under the tied names
/// `a_name` and `b_name` (elements from `offset` on), differ once cast to
/// `dtype`: names both, the first element that differs, and the option.
void require_equal_tied(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype, const std::string& a_name,
                        const std::string& b_name, int64_t offset, const std::string& where, const char* option);

/// This rank's share of comparing `numel` elements among `ranks`: (first, count).
std::pair<int64_t, int64_t> share_of(int64_t numel, int rank, int ranks);

}  // namespace shardtorch::checkpoint
