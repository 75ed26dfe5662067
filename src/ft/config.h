#pragma once
// Internal: what every replica group must have alike (compared across the
// groups in every quorum), aspect by aspect, in words.
#include <torch/nn/module.h>

#include <boost/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "shardtorch/shard_options.h"

namespace shardtorch::ft::detail {

/// (aspect, its value in words): strategy, mixed precision, world size,
/// parameters, optimizer (its hyperparameters as they are when the Manager
/// is made).
using Config = std::vector<std::pair<std::string, std::string>>;

Config describe_config(torch::nn::Module& root, const ShardOptions& options, const std::string& optimizer,
                       int world_size);
/// The values, comma-separated (the manager's first log line).
std::string config_text(const Config& c);
/// Where `a` (group `ga`'s) and `b` (group `gb`'s) differ, aspect by aspect.
std::string config_difference(const std::string& ga, const Config& a, const std::string& gb, const Config& b);
boost::json::array config_json(const Config& c);
/// config_json's inverse; throws on anything else.
Config config_of(const boost::json::value& v);

}  // namespace shardtorch::ft::detail
