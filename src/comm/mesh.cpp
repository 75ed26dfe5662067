#include "shardtorch/mesh.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "base/check.h"

namespace shardtorch {
namespace {

std::string text(const DeviceMesh::Dims& dims) {
  std::ostringstream os;
  for (size_t i = 0; i < dims.size(); ++i) os << (i ? " x " : "") << dims[i].first << " " << dims[i].second;
  return dims.empty() ? std::string("(no dimensions)") : os.str();
}

// What is wrong with `dims` for a world of `n` ranks ("" if nothing).
std::string invalid(const DeviceMesh::Dims& dims, int n) {
  if (dims.empty()) return "a mesh needs at least one dimension";
  std::set<std::string> names;
  int64_t product = 1;
  for (const auto& [name, size] : dims) {
    if (name.empty()) return "a dimension has an empty name";
    if (!names.insert(name).second) return "dimension '" + name + "' is named twice";
    if (size < 1) return "dimension '" + name + "' has size " + std::to_string(size) + " (at least 1)";
    product *= size;
  }
  if (product != n)
    return "the sizes multiply to " + std::to_string(product) + ", not to the world's " + std::to_string(n) + " ranks";
  return "";
}

}  // namespace

std::shared_ptr<DeviceMesh> DeviceMesh::create(std::shared_ptr<World> world, const Dims& dims) {
  SHARDTORCH_CHECK(world, "shardtorch: DeviceMesh::create: no world");
  World& w = *world;
  const std::string mine = text(dims);
  // Agree first: a rank that throws alone would leave the others waiting in
  // the groups' rendezvous. Every rank compares with rank 0 and throws the same.
  const auto all = w.comm().all_gather_strings(mine, "the device mesh's dimensions");
  for (int r = 0; r < w.size(); ++r)
    SHARDTORCH_CHECK(all[r] == all[0], detail::rank_prefix(w.global_rank()),
                     ": DeviceMesh::create was given other dimensions on rank ", w.global_rank_of(r), " (", all[r],
                     ") than on rank ", w.global_rank_of(0), " (", all[0], "); every rank must pass the same");
  const std::string why = invalid(dims, w.size());
  SHARDTORCH_CHECK(why.empty(), detail::rank_prefix(w.global_rank()), ": DeviceMesh ", mine, ": ", why);
  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->world_ = std::move(world);
  mesh->dims_ = dims;
  // Row-major: the last dimension varies fastest.
  int rest = w.rank();
  mesh->coords_.assign(dims.size(), 0);
  for (size_t i = dims.size(); i-- > 0;) {
    mesh->coords_[i] = rest % dims[i].second;
    rest /= dims[i].second;
  }
  for (const auto& [name, size] : dims) {
    mesh->groups_.push_back(w.subworld(mesh->ranks(name), "mesh " + mine + " along " + name));
  }
  return mesh;
}

size_t DeviceMesh::index_of(const std::string& dim) const {
  for (size_t i = 0; i < dims_.size(); ++i)
    if (dims_[i].first == dim) return i;
  std::string names;
  for (const auto& d : dims_) names += (names.empty() ? "" : ", ") + d.first;
  SHARDTORCH_CHECK(false, detail::rank_prefix(world_->global_rank()), ": the device mesh ", describe(),
                   " has no dimension '", dim, "' (it has ", names, ")");
}

const std::shared_ptr<World>& DeviceMesh::group(const std::string& dim) const { return groups_[index_of(dim)]; }

int DeviceMesh::size(const std::string& dim) const { return dims_[index_of(dim)].second; }

int DeviceMesh::coordinate(const std::string& dim) const { return coords_[index_of(dim)]; }

int DeviceMesh::rank_at(const std::vector<int>& coordinates) const {
  SHARDTORCH_CHECK(coordinates.size() == dims_.size(), "shardtorch: DeviceMesh::rank_at: ", coordinates.size(),
                   " coordinates for a mesh of ", dims_.size(), " dimensions (", describe(), ")");
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    SHARDTORCH_CHECK(coordinates[i] >= 0 && coordinates[i] < dims_[i].second,
                     "shardtorch: DeviceMesh::rank_at: ", dims_[i].first, " coordinate ", coordinates[i],
                     " is outside [0, ", dims_[i].second, ")");
    r = r * dims_[i].second + coordinates[i];
  }
  return r;
}

std::vector<int> DeviceMesh::ranks(const std::string& dim) const {
  const size_t d = index_of(dim);
  std::vector<int> c = coords_, out;
  for (int k = 0; k < dims_[d].second; ++k) {
    c[d] = k;
    out.push_back(rank_at(c));
  }
  return out;
}

std::string DeviceMesh::describe() const { return text(dims_); }

}  // namespace shardtorch
