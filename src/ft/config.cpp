#include "ft/config.h"

#include <algorithm>
#include <optional>
#include <sstream>

namespace shardtorch::ft::detail {
namespace json = boost::json;

namespace {

// Mixed precision as far as it changes what crosses the groups: the dtype of
// the gradients they all-reduce, of the buffers a heal sends, and which
// flats batch norm's parameters are in; and the compute dtype.
std::string describe_precision(const MixedPrecision& mp) {
  if (!mp.param_dtype() && !mp.buffer_dtype()) return "no mixed precision";
  auto name = [](const std::optional<at::ScalarType>& t) {
    return t ? std::string(c10::toString(*t)) : std::string("their own dtype");
  };
  const auto reduce = mp.param_dtype() ? std::optional(mp.reduce_dtype().value_or(*mp.param_dtype())) : std::nullopt;
  return "mixed precision (parameters in " + name(mp.param_dtype()) + ", gradients reduced in " + name(reduce) +
         ", buffers in " + name(mp.buffer_dtype()) + ", batch norm " +
         (mp.keep_batch_norm_fp32() ? "kept in its own dtype" : "cast like the rest") + ")";
}

}  // namespace

Config describe_config(torch::nn::Module& root, const ShardOptions& o, const std::string& optimizer, int world_size) {
  int64_t numel = 0, n = 0;
  std::size_t h = 0;
  for (const auto& item : root.named_parameters()) {
    ++n;
    numel += item.value().numel();
    h = h * 1000003u ^ std::hash<std::string>()(item.key());
    for (auto s : item.value().sizes()) h = h * 31u + static_cast<std::size_t>(s);
  }
  std::ostringstream strategy, params;
  strategy << strategy_name(o.strategy());
  if (o.strategy() == Strategy::HybridShard) strategy << " (shard groups of " << o.hybrid_shard_size() << ")";
  if (o.cpu_offload()) strategy << " with CPU offload";
  params << n << " parameters of " << numel << " elements (names and shapes " << std::hex << (h & 0xffffffffu) << ")";
  return {{"strategy", strategy.str()},
          {"mixed precision", describe_precision(o.mixed_precision())},
          {"world size", std::to_string(world_size) + (world_size == 1 ? " rank" : " ranks")},
          {"parameters", params.str()},
          {"optimizer", optimizer}};
}

std::string config_text(const Config& c) {
  std::string s;
  for (const auto& [aspect, text] : c) s += (s.empty() ? "" : ", ") + text;
  return s;
}

std::string config_difference(const std::string& ga, const Config& a, const std::string& gb, const Config& b) {
  std::string s;
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    const std::string aspect = i < a.size() ? a[i].first : b[i].first;
    const std::string x = i < a.size() ? a[i].second : "nothing", y = i < b.size() ? b[i].second : "nothing";
    if (x != y) s += (s.empty() ? "" : "; ") + aspect + ": '" + ga + "' has " + x + ", '" + gb + "' has " + y;
  }
  return s;
}

json::array config_json(const Config& c) {
  json::array a;
  for (const auto& [aspect, text] : c) a.push_back(json::array{json::string(aspect), json::string(text)});
  return a;
}

Config config_of(const json::value& v) {
  Config c;
  for (const auto& x : v.as_array()) {
    const auto& pair = x.as_array();
    c.emplace_back(json::value_to<std::string>(pair.at(0)), json::value_to<std::string>(pair.at(1)));
  }
  return c;
}

}  // namespace shardtorch::ft::detail
