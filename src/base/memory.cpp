#include "base/memory_tracker.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace shardtorch {

const char* mem_name(Mem m) {
  switch (m) {
    case Mem::ShardedParams:
      return "sharded_params";
    case Mem::ReplicatedParams:
      return "replicated_params";
    case Mem::Gradients:
      return "gradients";
    case Mem::OptimizerState:
      return "optimizer_state";
    case Mem::GatheredParams:
      return "gathered_params";
    case Mem::GradStaging:
      return "grad_staging";
    case Mem::Buckets:
      return "buckets";
    case Mem::MasterGrads:
      return "master_grads";
    case Mem::HostParams:
      return "host_params";
    case Mem::HostGradients:
      return "host_gradients";
    case Mem::HostOptimizerState:
      return "host_optimizer_state";
    case Mem::SummonedGrads:
      return "summoned_grads";
    case Mem::Snapshots:
      return "snapshots";
    default:
      return "?";
  }
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::abs(v) >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string MemorySnapshot::report() const {
  std::ostringstream os;
  const std::string who = rank >= 0 ? "[rank " + std::to_string(rank) + "] " : "";
  for (int i = 0; i < static_cast<int>(Mem::kCount); ++i) {
    os << who << mem_name(static_cast<Mem>(i)) << " " << format_bytes(current[i]) << " (peak " << format_bytes(peak[i])
       << ")\n";
  }
  os << who << "gathered_units " << gathered_units << " (peak " << peak_gathered_units << ")\n";
  return os.str();
}

void MemoryTracker::add(Mem m, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto i = static_cast<size_t>(m);
  snap_.current[i] += bytes;
  snap_.peak[i] = std::max(snap_.peak[i], snap_.current[i]);
}

void MemoryTracker::set(Mem m, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto i = static_cast<size_t>(m);
  snap_.current[i] = bytes;
  snap_.peak[i] = std::max(snap_.peak[i], snap_.current[i]);
}

void MemoryTracker::unit_gathered() {
  std::lock_guard<std::mutex> lock(mu_);
  snap_.gathered_units += 1;
  snap_.peak_gathered_units = std::max(snap_.peak_gathered_units, snap_.gathered_units);
}

void MemoryTracker::unit_released() {
  std::lock_guard<std::mutex> lock(mu_);
  snap_.gathered_units -= 1;
}

void MemoryTracker::reset_peaks() {
  std::lock_guard<std::mutex> lock(mu_);
  snap_.peak = snap_.current;
  snap_.peak_gathered_units = snap_.gathered_units;
}

MemorySnapshot MemoryTracker::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return snap_;
}

}  // namespace shardtorch
