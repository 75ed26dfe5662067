#include "ft/heal.h"

#include <c10/core/GradMode.h>

#include <cstring>
#include <vector>

#include "base/log.h"

namespace shardtorch::ft::detail {

using Clock = std::chrono::steady_clock;

namespace {

int64_t ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// Gloo sends and receives host memory only (it reads a tensor's data
// pointer): state on a device goes through a host copy.
at::Tensor host(const at::Tensor& t) { return t.to(at::kCPU).contiguous(); }
at::Tensor host_like(const at::Tensor& t) { return at::empty(t.sizes(), t.options().device(at::kCPU)); }

// The header's slots: the step, the program state's length, then per piece
// its count of optimizer tensors and its optimizer step.
at::Tensor header(size_t pieces) { return at::zeros({static_cast<int64_t>(2 + 2 * pieces)}, at::kLong); }
int64_t count_slot(size_t piece) { return static_cast<int64_t>(2 + 2 * piece); }
int64_t step_slot(size_t piece) { return static_cast<int64_t>(3 + 2 * piece); }

}  // namespace

int64_t StateTransfer::send(c10d::Backend& pg, int dst, int tag, int64_t step) {
  c10::NoGradGuard no_grad;
  const auto states = optimizer_.states();
  const std::string user = user_.save ? user_.save() : std::string();
  at::Tensor meta = header(states.size());
  auto m = meta.accessor<int64_t, 1>();
  m[0] = step;
  m[1] = static_cast<int64_t>(user.size());
  std::vector<at::Tensor> out;
  for (auto& t : model_.state_tensors()) out.push_back(host(t));
  for (size_t i = 0; i < states.size(); ++i) {
    m[count_slot(i)] = static_cast<int64_t>(states[i].tensors.size());
    m[step_slot(i)] = states[i].step;
    for (auto& t : states[i].tensors) out.push_back(host(t));
  }
  if (!user.empty()) {
    at::Tensor u = at::empty({static_cast<int64_t>(user.size())}, at::kByte);
    std::memcpy(u.data_ptr(), user.data(), user.size());
    out.push_back(u);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> one{meta};
  works.push_back(pg.send(one, dst, tag));
  for (auto& t : out) {
    std::vector<at::Tensor> v{t};
    works.push_back(pg.send(v, dst, tag));
  }
  for (auto& w : works) w->wait(timeout_);
  int64_t bytes = static_cast<int64_t>(meta.nbytes());
  for (auto& t : out) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

int64_t StateTransfer::receive(c10d::Backend& pg, int src, int tag) {
  c10::NoGradGuard no_grad;
  const auto pieces = optimizer_.pieces();
  at::Tensor meta = header(pieces.size());
  std::vector<at::Tensor> one{meta};
  pg.recv(one, src, tag)->wait(timeout_);
  auto m = meta.accessor<int64_t, 1>();
  std::vector<at::Tensor> dst = model_.state_tensors(), got;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  auto post = [&](at::Tensor t) {
    got.push_back(t);
    std::vector<at::Tensor> v{t};
    works.push_back(pg.recv(v, src, tag));
  };
  // Into host memory (Gloo's receives write through the data pointer);
  // copied to where the state lives once everything arrived.
  for (auto& t : dst) post(host_like(t));
  for (size_t i = 0; i < pieces.size(); ++i)
    for (int64_t k = 0; k < m[count_slot(i)]; ++k) post(host_like(pieces[i]));
  const int64_t user_len = m[1];
  if (user_len > 0) post(at::empty({user_len}, at::kByte));
  int64_t bytes = 0;
  for (const auto& t : got) bytes += static_cast<int64_t>(t.nbytes());
  shardtorch::detail::ProgressReporter progress("heal", "tensors", static_cast<int64_t>(works.size()), bytes);
  for (size_t i = 0; i < works.size(); ++i) {
    works[i]->wait(timeout_);
    progress.advance(1, static_cast<int64_t>(got[i].nbytes()));
  }
  progress.finish();
  // Everything arrived: replace (under CPU offload once no copy to the
  // device reads the masters any more).
  model_.replace_begin();
  size_t at = 0;
  for (auto& t : dst) t.copy_(got[at++]);
  std::vector<shardtorch::detail::PieceState> states(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    states[i].step = m[step_slot(i)];
    for (int64_t k = 0; k < m[count_slot(i)]; ++k) states[i].tensors.push_back(got[at++]);
  }
  optimizer_.install(std::move(states));
  if (user_len > 0 && user_.load) {
    const at::Tensor& u = got[at];
    user_.load(std::string(static_cast<const char*>(u.data_ptr()), static_cast<size_t>(user_len)));
  }
  return m[0];
}

void StateTransfer::heal(const Quorum& q, c10d::Backend& pg, int64_t& step, const FtLog& log) {
  for (size_t h = 0; h < q.heals.size(); ++h) {
    auto [healed, source] = q.heals[h];
    const int tag = 7000 + static_cast<int>(h);
    const auto t0 = Clock::now();
    if (source == q.me) {
      const int64_t bytes = send(pg, healed, tag, step);
      log("step " + std::to_string(step) + ": sent this rank's state (" + std::to_string(bytes) + " bytes) to '" +
          q.participants[healed].group + "' in " + std::to_string(ms_since(t0)) + " ms");
    } else if (healed == q.me) {
      const int64_t from_step = step;
      step = receive(pg, source, tag);
      log("healed from '" + q.participants[source].group + "': step " + std::to_string(from_step) + " -> " +
          std::to_string(step) + " in " + std::to_string(ms_since(t0)) + " ms");
    }
  }
}

}  // namespace shardtorch::ft::detail
