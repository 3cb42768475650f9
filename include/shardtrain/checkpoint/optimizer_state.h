// Optimizer state as sharded checkpoint entries, so it reshards like the
// parameters.
//
// For each parameter P of the optimizer (a ShardedTensor of
// Strategy::optimizer_parameters(): a whole tensor or a 1-D run of it):
//   AdamW, Adam  optim.P.exp_avg, optim.P.exp_avg_sq (and optim.P.max_exp_avg_sq
//                with amsgrad): P's global shape, P's slice, P's primary flag;
//                optim.P.step: a scalar int64, written by the one rank that
//                holds P's element 0 as primary
//   SGD          optim.P.momentum_buffer (when momentum is on and a step ran)
// Parameters without state yet (no step taken) contribute nothing; loading
// such a checkpoint leaves them without state, as a fresh optimizer has.
// The step of a zero-element parameter is not stored (no element holds it):
// it is restored as the largest step of the other parameters.
//
// Saving:   tensors = strategy.sharded_state_dict() + optimizer_state(opt, params)
// Loading:  load_optimizer_state(dir, comm, opt, params)
#pragma once

#include <string>
#include <vector>

#include "shardtrain/checkpoint/checkpoint.h"

namespace torch::optim {
class Optimizer;
}

namespace shardtrain::checkpoint {

/// The state of `optimizer` (AdamW, Adam or SGD) for `params`, the tensors
/// it was built over (matched by TensorImpl), as checkpoint entries whose
/// `local` tensors alias the optimizer's state. InvalidArgument for another
/// optimizer type or a parameter the optimizer does not hold.
std::vector<ShardedTensor> optimizer_state(torch::optim::Optimizer& optimizer,
                                           const std::vector<ShardedTensor>& params);

/// The entries `params` need from a checkpoint described by `metadata`: for
/// every optim.<name>.<key> it holds for one of `params`, a zero tensor of
/// the stored dtype shaped like the parameter's local piece (a scalar for
/// step). Fill them with CheckpointReader::read or load_sharded.
std::vector<ShardedTensor> optimizer_state_targets(const Metadata& metadata,
                                                   const std::vector<ShardedTensor>& params);

/// Installs `entries` (from optimizer_state() or filled
/// optimizer_state_targets()) into `optimizer`'s state for `params`,
/// creating state a fresh optimizer does not have yet. Parameters without
/// entries are left alone. CheckpointError when an entry's shape or slice
/// does not match its parameter, or when a parameter's entries are
/// incomplete (e.g. exp_avg without exp_avg_sq).
void set_optimizer_state(torch::optim::Optimizer& optimizer,
                         const std::vector<ShardedTensor>& params,
                         const std::vector<ShardedTensor>& entries);

/// Collective: optimizer_state_targets + load_sharded + set_optimizer_state.
/// Works for any world size and slicing of `params`.
void load_optimizer_state(const std::string& dir, comm::Communicator& comm,
                          torch::optim::Optimizer& optimizer,
                          const std::vector<ShardedTensor>& params);

}  // namespace shardtrain::checkpoint
