#include "shardtorch/grad_scaler.h"
#include "base/check.h"

#include <c10/core/GradMode.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <system_error>

#include "runtime/shard_state.h"

namespace shardtorch {

GradScaler::GradScaler(torch::nn::Module& root, GradScalerOptions options)
    : state_(detail::require_state(root, "GradScaler")), options_(options), scale_(options.init_scale()) {
  // Finite: an infinite scale would skip every step for ever (inf * backoff = inf).
  SHARDTORCH_CHECK(std::isfinite(scale_) && scale_ > 0 && std::isfinite(options.growth_factor()) &&
                       options.growth_factor() > 1 && options.backoff_factor() > 0 && options.backoff_factor() < 1 &&
                       options.growth_interval() >= 1,
                   "shardtorch::GradScaler: need a finite init_scale > 0 (got ", scale_,
                   "), a finite growth_factor > 1 (got ", options.growth_factor(), "), 0 < backoff_factor < 1 (got ",
                   options.backoff_factor(), ") and growth_interval >= 1 (got ", options.growth_interval(), ")");
  state_->optimizer().set_has_scaler();
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const { return loss * scale_; }

void GradScaler::check_optimizer(const ShardedOptimizer& opt, const char* who) const {
  // Another model's optimizer would step on gradients this scaler never
  // divided nor checked.
  SHARDTORCH_CHECK(opt.views().state() == state_.get(), detail::rank_prefix(state_->world().global_rank()),
                   ": GradScaler::", who,
                   ": the optimizer is over another model than the one this scaler was made for (one GradScaler per "
                   "sharded model)");
}

void GradScaler::unscale(ShardedOptimizer& opt) {
  check_optimizer(opt, "unscale");
  // Once per value of the gradients: after a backward or a zero_grad (a step
  // the user chose not to take after unscale) they are scaled again. A step,
  // taken or skipped, leaves them as they are: unscaled.
  if (unscaled_at_ == state_->backward().gradient_generation()) return;
  c10::NoGradGuard no_grad;
  bool partial = false;
  for (auto& g : state_->optimizer().local_gradients(partial)) g.mul_(1.0 / scale_);
  unscaled_at_ = state_->backward().gradient_generation();
}

bool GradScaler::step(ShardedOptimizer& opt) {
  check_optimizer(opt, "step");
  unscale(opt);
  bool partial = false;
  bool found = false;
  for (auto& g : state_->optimizer().local_gradients(partial)) {
    if (!at::isfinite(g).all().item<bool>()) {
      found = true;
      break;
    }
  }
  // Every rank must make the same decision, whatever part of the gradients it holds.
  auto& comm = state_->world().comm();
  auto flag = at::full({1}, found ? 1.0f : 0.0f).to(comm.device());
  comm.all_reduce(flag, c10d::ReduceOp::MAX, "GradScaler inf/nan check");
  if (flag.cpu().item<float>() > 0) {
    scale_ *= options_.backoff_factor();
    good_steps_ = 0;
    ++skipped_;
    return false;
  }
  opt.step();  // if it throws (refused), the gradients stay marked unscaled: a retry does not divide again
  if (++good_steps_ >= options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    good_steps_ = 0;
  }
  return true;
}

namespace {
constexpr const char* kScale = "grad_scaler.scale";
constexpr const char* kGoodSteps = "grad_scaler.good_steps";
constexpr const char* kSkipped = "grad_scaler.skipped_steps";

const std::string& entry(const std::map<std::string, std::string>& state, const char* key) {
  auto it = state.find(key);
  SHARDTORCH_CHECK(it != state.end(), "shardtorch::GradScaler::load_state_dict: no '", key,
                   "' (pass what GradScaler::state_dict() gave, e.g. inside a checkpoint's user_state)");
  return it->second;
}

// The whole string must be the number, in the C locale whatever the
// process's (from_chars: no spaces, no sign "+", no "12abc").
template <typename T>
T parse(const std::map<std::string, std::string>& state, const char* key) {
  const std::string& text = entry(state, key);
  T value{};
  const auto [end, err] = std::from_chars(text.data(), text.data() + text.size(), value);
  SHARDTORCH_CHECK(err == std::errc() && end == text.data() + text.size(), "shardtorch::GradScaler::load_state_dict: '",
                   key, "' is '", text, "', not a number");
  return value;
}
}  // namespace

std::map<std::string, std::string> GradScaler::state_dict() const {
  char scale[64];
  const auto written = std::to_chars(scale, scale + sizeof scale, scale_);  // shortest text that reads back exactly
  TORCH_INTERNAL_ASSERT(written.ec == std::errc());
  return {{kScale, std::string(scale, written.ptr)},
          {kGoodSteps, std::to_string(good_steps_)},
          {kSkipped, std::to_string(skipped_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, std::string>& state) {
  const double scale = parse<double>(state, kScale);
  const int64_t good = parse<int64_t>(state, kGoodSteps);
  const int64_t skipped = parse<int64_t>(state, kSkipped);
  SHARDTORCH_CHECK(std::isfinite(scale) && scale > 0, "shardtorch::GradScaler::load_state_dict: '", kScale, "' is ",
                   scale, ", not a positive finite scale");
  // A good-step count at or past growth_interval (a run resumed with a
  // smaller one) grows the scale at the next good step.
  SHARDTORCH_CHECK(good >= 0 && skipped >= 0, "shardtorch::GradScaler::load_state_dict: '", kGoodSteps, "' is ", good,
                   " and '", kSkipped, "' ", skipped, "; neither may be negative");
  SHARDTORCH_CHECK(good <= std::numeric_limits<int>::max(), "shardtorch::GradScaler::load_state_dict: '", kGoodSteps,
                   "' is ", good, ", more than this scaler counts (", std::numeric_limits<int>::max(), ")");
  scale_ = scale;
  good_steps_ = static_cast<int>(good);
  skipped_ = skipped;
}

}  // namespace shardtorch
