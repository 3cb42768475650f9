// The device mesh: the world as a grid of named dimensions, outermost first,
//
//   pp × dp_replicate × dp_shard × tp
//
// and one sub-communicator per dimension, made once. A rank's coordinates
// follow from its world rank, tp fastest:
//
//   rank = ((pp_i · dp_replicate + rep_i) · dp_shard + shard_i) · tp + tp_i
//
// so a tensor-parallel group is consecutive ranks (one host, the shared-
// memory path) and pipeline stages lie furthest apart (across hosts).
// Every strategy works on the data-parallel ranks alone: dp() spans
// dp_replicate × dp_shard; hybrid sharding shards within dp_shard and
// replicates across dp_replicate. Nothing else in shardtrain makes groups.
//
//   auto mesh = DeviceMesh::create(world, MeshShape().tp(2).dp_shard(2));
//   mesh.tp()->all_reduce(partial);        // the ranks that split each layer
//   strategy->setup(model, mesh);          // gradients averaged over mesh.dp()
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shardtrain/core/options.h"

namespace shardtrain::comm {

class Communicator;

/// Sizes of the mesh's dimensions. Their product must be the world size.
struct MeshShape {
  ST_ARG(int, pp) = 1;
  ST_ARG(int, dp_replicate) = 1;
  ST_ARG(int, dp_shard) = 1;
  ST_ARG(int, tp) = 1;

 public:
  int world() const { return pp_ * dp_replicate_ * dp_shard_ * tp_; }
  int dp() const { return dp_replicate_ * dp_shard_; }
  /// "pp1 x dp_replicate1 x dp_shard2 x tp2".
  std::string describe() const;
};

/// The shape for `world` ranks, `local_world_size` of them per host: tp and
/// pp as given, the rest data-parallel. With `hybrid`, dp_shard spans the
/// data-parallel ranks of one host and dp_replicate the hosts; otherwise
/// dp_shard holds them all. ConfigError (naming distributed.tensor_parallel)
/// when tp does not divide the ranks per host (a tensor-parallel group must
/// share a host) or tp · pp does not divide the world.
MeshShape mesh_shape_for(int world, int local_world_size, int tp, int pp, bool hybrid);

class DeviceMesh {
 public:
  /// Collective over `world`: every rank calls it with the same shape.
  /// ConfigError when shape.world() != world->size().
  static DeviceMesh create(std::shared_ptr<Communicator> world, const MeshShape& shape);

  const MeshShape& shape() const { return shape_; }
  const std::shared_ptr<Communicator>& world() const { return world_; }
  /// This rank's group along each dimension (a group of one where the
  /// dimension has size 1).
  const std::shared_ptr<Communicator>& pp() const { return pp_; }
  const std::shared_ptr<Communicator>& dp_replicate() const { return dp_replicate_; }
  const std::shared_ptr<Communicator>& dp_shard() const { return dp_shard_; }
  const std::shared_ptr<Communicator>& tp() const { return tp_; }
  /// dp_replicate × dp_shard: the ranks that see different data.
  const std::shared_ptr<Communicator>& dp() const { return dp_; }

 private:
  MeshShape shape_;
  std::shared_ptr<Communicator> world_, pp_, dp_replicate_, dp_shard_, tp_, dp_;
};

}  // namespace shardtrain::comm
