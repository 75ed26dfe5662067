#include "optim/replica_optimizer.h"

#include "base/check.h"
#include "optim/optimizer_state.h"
#include "shardtorch/optim.h"

namespace shardtorch::detail {

std::string ReplicaOptimizer::describe() const { return describe_optimizer(opt_); }

std::vector<at::Tensor> ReplicaOptimizer::pieces() const {
  std::vector<at::Tensor> out;
  for (const auto& p : opt_.views().pieces()) out.push_back(p.view);
  return out;
}

std::vector<PieceState> ReplicaOptimizer::states() const {
  const auto& st = opt_.inner().state();
  std::vector<PieceState> out;
  for (const auto& p : opt_.views().pieces()) {
    PieceState s;
    auto it = st.find(p.view.unsafeGetTensorImpl());
    if (it != st.end()) {
      s.step = optimizer_state_step(it->second.get());
      for (auto& [name, t] : optimizer_state_tensors(it->second.get())) s.tensors.push_back(t);
    }
    out.push_back(std::move(s));
  }
  return out;
}

void ReplicaOptimizer::install(std::vector<PieceState> states) {
  const auto& pieces = opt_.views().pieces();
  TORCH_INTERNAL_ASSERT(states.size() == pieces.size(), "ReplicaOptimizer::install: ", states.size(), " states for ",
                        pieces.size(), " pieces");
  const auto kind = optimizer_kind(opt_);
  bool any = false;
  for (const auto& s : states) any = any || !s.tensors.empty();
  SHARDTORCH_CHECK(kind || !any, "shardtorch: ", describe_optimizer(opt_),
                   ": cannot install the state of this optimizer (Adam, AdamW and SGD only)");
  auto& st = opt_.inner().state();
  for (size_t i = 0; i < pieces.size(); ++i) {
    void* key = pieces[i].view.unsafeGetTensorImpl();
    if (states[i].tensors.empty()) {
      st.erase(key);
      continue;
    }
    for (auto& t : states[i].tensors) t = t.to(pieces[i].view.device());  // the state lives with its piece
    st[key] = make_optimizer_state(*kind, states[i].step, states[i].tensors);
  }
  opt_.views().count_optimizer_state(opt_.inner());
}

}  // namespace shardtorch::detail
