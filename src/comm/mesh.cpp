// The device mesh: one sub-communicator per dimension, made once.
#include "shardtrain/comm/mesh.h"

#include <algorithm>
#include <vector>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/launch/env.h"

namespace shardtrain::comm {

using ::shardtrain::detail::str_cat;

std::string MeshShape::describe() const {
  return str_cat("pp", pp_, " x dp_replicate", dp_replicate_, " x dp_shard", dp_shard_, " x tp", tp_);
}

MeshShape mesh_shape_for(int world, int local_world_size, int tp, int pp, bool hybrid) {
  ST_CHECK(tp >= 1 && pp >= 1, ConfigError, "distributed.tensor_parallel=", tp,
           " and pipeline_parallel=", pp, " must be at least 1");
  // Nodes with different numbers of ranks (shardtrain launch says so in
  // SHARDTRAIN_NODE_SIZES) have no one per-host size for a tensor-parallel
  // group or a hybrid shard to follow: every rank would see another.
  if (tp > 1 || hybrid) {
    const std::vector<int> sizes = dist::node_sizes_from_env();
    if (tp > 1) {
      dist::require_even_nodes(sizes, str_cat("distributed.tensor_parallel=", tp),
                               "set distributed.tensor_parallel: 1, or start the same --nproc-per-node "
                               "on every node");
    }
    if (hybrid) {
      dist::require_even_nodes(sizes, "distributed.sharding=hybrid_shard",
                               "set distributed.sharding: full_shard (or strategy ddp or zero1), "
                               "or start the same --nproc-per-node on every node");
    }
  }
  const int local = local_world_size >= 1 ? local_world_size : world;
  ST_CHECK(local % tp == 0, ConfigError, "distributed.tensor_parallel=", tp,
           " does not divide the ", local, " ranks per host: a tensor-parallel group must share one "
           "host (its traffic is every layer's); start a multiple of ", tp,
           " ranks per node or lower distributed.tensor_parallel");
  ST_CHECK(world % (tp * pp) == 0, ConfigError, "distributed.tensor_parallel=", tp, " x pipeline_parallel=",
           pp, " does not divide the world of ", world, " ranks; the data-parallel size is what is left");
  const int dp = world / (tp * pp);
  MeshShape shape;
  shape.pp(pp).tp(tp);
  if (hybrid) {
    const int per_host = std::max(1, local / tp);
    ST_CHECK(dp % per_host == 0, ConfigError, "hybrid_shard needs the ", dp,
             " data-parallel ranks to be a multiple of the ", per_host,
             " per host; start the same number of ranks on every node (LOCAL_WORLD_SIZE)");
    shape.dp_shard(std::min(per_host, dp)).dp_replicate(dp / std::min(per_host, dp));
  } else {
    shape.dp_shard(dp);
  }
  return shape;
}

namespace {

// The world ranks of the group along one dimension through `rank`: the
// ranks whose other coordinates equal rank's. `stride` is the dimension's
// step in world ranks and `size` its length.
std::vector<int> line_through(int rank, int stride, int size) {
  const int first = rank - (rank / stride % size) * stride;
  std::vector<int> ranks;
  for (int i = 0; i < size; ++i) ranks.push_back(first + i * stride);
  return ranks;
}

// Makes the groups along a dimension: every rank calls new_group for every
// line in the same order and keeps its own. The world itself when the
// dimension spans it; a dimension of size 1 is a group of this rank alone.
std::shared_ptr<Communicator> make_dimension(const std::shared_ptr<Communicator>& world,
                                             int stride, int size) {
  const int n = world->size();
  if (size == n) return world;
  // No collective needed among one rank: a world of one, made locally.
  if (size == 1) return Communicator::create(CommOptions().backend(Backend::Gloo));
  std::shared_ptr<Communicator> mine;
  // Lines are enumerated by their first rank: those whose coordinate along
  // this dimension is 0.
  for (int r = 0; r < n; ++r) {
    if (r / stride % size != 0) continue;
    auto g = world->new_group(line_through(r, stride, size));
    if (g) mine = g;
  }
  return mine;
}

}  // namespace

DeviceMesh DeviceMesh::create(std::shared_ptr<Communicator> world, const MeshShape& shape) {
  ST_CHECK(world != nullptr, InvalidArgument, "DeviceMesh::create needs a communicator");
  ST_CHECK(shape.world() == world->size(), ConfigError, "the mesh ", shape.describe(), " holds ",
           shape.world(), " ranks but the world has ", world->size(),
           "; distributed.tensor_parallel and pipeline_parallel must divide the ranks");
  DeviceMesh m;
  m.shape_ = shape;
  m.world_ = world;
  const int tp = shape.tp(), shard = shape.dp_shard(), rep = shape.dp_replicate();
  m.tp_ = make_dimension(world, 1, tp);
  m.dp_shard_ = make_dimension(world, tp, shard);
  m.dp_replicate_ = make_dimension(world, tp * shard, rep);
  m.pp_ = make_dimension(world, tp * shard * rep, shape.pp());
  // dp: the ranks that share pp and tp coordinates (replicate x shard).
  if (rep == 1) {
    m.dp_ = m.dp_shard_;
  } else if (shard == 1) {
    m.dp_ = m.dp_replicate_;
  } else {
    const int n = world->size(), me = world->rank();
    for (int r = 0; r < n; ++r) {
      if ((r / tp) % (shard * rep) != 0) continue;  // the first rank of each dp plane
      std::vector<int> ranks;
      for (int i = 0; i < shard * rep; ++i) ranks.push_back(r + i * tp);
      auto g = world->new_group(ranks);
      if (g) m.dp_ = g;
    }
    ST_ASSERT(m.dp_ != nullptr, "rank ", me, " is in no data-parallel group of ", shape.describe());
  }
  ST_ASSERT(m.tp_ && m.dp_shard_ && m.dp_replicate_ && m.pp_, "mesh ", shape.describe(),
            " left rank ", world->rank(), " without a group");
  return m;
}

}  // namespace shardtrain::comm
