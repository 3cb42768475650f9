// Flat parameters: the data model of the sharded strategies.
//
// Each (requires_grad, dtype) group of a unit's parameters is one flat
// buffer, the parameters laid end to end and padded with zeros to a multiple
// of the shard group's size n. Rank r keeps elements [r*S, (r+1)*S),
// S = padded / n, as its shard. FlatLayout is that arithmetic alone, pure so
// that unit tests check it without a communicator; FlatParam adds the
// tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain::strategy::detail {

/// Where one parameter lies in its flat buffer and in one rank's shard.
struct ParamSlot {
  int64_t offset = 0;  // first element in the flat buffer
  int64_t numel = 0;
  // Elements [shard_begin, shard_begin + shard_count) of the shard hold the
  // parameter's elements from param_offset on (shard_count may be 0).
  int64_t shard_begin = 0;
  int64_t shard_count = 0;
  int64_t param_offset = 0;
};

struct FlatLayout {
  int64_t numel = 0;         // sum of the parameters' elements
  int64_t padded = 0;        // numel rounded up to a multiple of the shard count
  int64_t shard_numel = 0;   // padded / shards
  int64_t shard_offset = 0;  // rank * shard_numel
  std::vector<ParamSlot> slots;
};

/// The layout of parameters of `numels` elements, in that order, sharded
/// over `shards` ranks, as rank `rank` sees it. shards >= 1, 0 <= rank < shards.
/// Each shard's element count is a multiple of `shard_multiple` (>= 1).
FlatLayout plan_flat(const std::vector<int64_t>& numels, int shards, int rank,
                     int64_t shard_multiple = 1);

/// Elements per shard a flat of `dtype` must be a multiple of so that
/// as_words() can view its shards: 4 for 1-byte dtypes, 2 for int16, else 1.
int64_t word_multiple(at::ScalarType dtype);

/// A contiguous flat buffer as the communicator can carry it: itself, or
/// for dtypes it has no type for (uint8, int8, int16, bool) the same bytes
/// as int32, so frozen quantized codes are gathered as raw bytes at their
/// stored size. Its byte count must be a multiple of 4.
at::Tensor as_words(const at::Tensor& flat);

/// One parameter of a flat buffer.
struct FlatMember {
  std::string name;
  at::Tensor var;  // the module's parameter; its data is a view of FlatParam::full
  std::vector<int64_t> shape;
  size_t order = 0;  // position in the model's named_parameters()
  ParamSlot slot;
};

/// A flat buffer with its shard, gradients and the optimizer's views.
struct FlatParam {
  size_t unit = 0;
  bool trainable = false;
  at::ScalarType master_dtype = at::kFloat;
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  FlatLayout layout;
  std::vector<FlatMember> params;

  at::Tensor full;        // compute dtype, [padded]; released while sharded
  at::Tensor shard;       // master dtype, [shard_numel]; a view of full when they coincide
  at::Tensor gather_src;  // what all_gather sends: shard, or its compute-dtype copy
  at::Tensor grad_full;   // compute dtype, [padded]; the parameters' .grad are views of it
  std::vector<bool> grad_unwritten;  // per parameter: its part of a new grad_full is not yet written
  at::Tensor grad_shard;  // master dtype, [shard_numel]: the optimizer's gradients
  bool grad_shard_is_view = false;
  std::vector<at::Tensor> opt_params;  // per parameter: its slice of shard
  std::vector<at::Tensor> opt_grads;   // per parameter: its slice of grad_shard

  /// Parameter i's elements in this rank's shard: in its own shape when the
  /// shard is the whole buffer (`whole`), else 1-D.
  at::Tensor shard_slice(size_t i, bool whole) const;
  /// Allocates grad_full if absent and makes every parameter's .grad a view
  /// of it: the view takes what the .grad held (zeros for none) when it is
  /// new, and adds it when the view already held a sum.
  void adopt_grads();
  void adopt_grad(size_t i);
};

}  // namespace shardtrain::strategy::detail
