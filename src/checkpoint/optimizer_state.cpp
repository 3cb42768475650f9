// Optimizer state <-> checkpoint entries for AdamW, Adam and SGD.
//
// LibTorch keys optimizer state by the string of the parameter's
// TensorImpl pointer (c10::guts::to_string(p.unsafeGetTensorImpl())), so the
// state of a parameter is found through the very tensor the optimizer was
// built over: ShardedTensor::local of optimizer_parameters().
#include "shardtrain/checkpoint/optimizer_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"

namespace shardtrain::checkpoint {

namespace {

enum class Kind { AdamW, Adam, SGD };

Kind kind_of(torch::optim::Optimizer& opt) {
  if (dynamic_cast<torch::optim::AdamW*>(&opt)) return Kind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(&opt)) return Kind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(&opt)) return Kind::SGD;
  ST_CHECK(false, InvalidArgument,
           "checkpoints store the state of AdamW, Adam and SGD optimizers only; this optimizer "
           "is none of them");
  return Kind::SGD;
}

std::string key_of(const at::Tensor& p) { return c10::guts::to_string(p.unsafeGetTensorImpl()); }

// Whether the param group holding `p` uses amsgrad (Adam/AdamW).
bool amsgrad_for(torch::optim::Optimizer& opt, Kind kind, const at::Tensor& p) {
  for (auto& group : opt.param_groups()) {
    for (const auto& q : group.params()) {
      if (!q.is_same(p)) continue;
      if (kind == Kind::AdamW) return static_cast<torch::optim::AdamWOptions&>(group.options()).amsgrad();
      if (kind == Kind::Adam) return static_cast<torch::optim::AdamOptions&>(group.options()).amsgrad();
      return false;
    }
  }
  return false;
}

void check_held(torch::optim::Optimizer& opt, const std::vector<ShardedTensor>& params) {
  std::unordered_set<const void*> held;
  for (auto& group : opt.param_groups()) {
    for (const auto& q : group.params()) held.insert(q.unsafeGetTensorImpl());
  }
  for (const auto& p : params) {
    ST_CHECK(p.local.defined() && held.count(p.local.unsafeGetTensorImpl()), InvalidArgument,
             "parameter '", p.name,
             "' is not one the optimizer was built over; pass the tensors of "
             "strategy->optimizer_parameters() the optimizer holds");
  }
}

std::string entry_name(const ShardedTensor& p, const char* key) {
  return "optim." + p.name + "." + key;
}

ShardedTensor entry_like(const ShardedTensor& p, const char* key, at::Tensor local) {
  ST_CHECK(local.numel() == p.local.numel(), InvalidArgument, "optimizer state '", key, "' of '",
           p.name, "' has ", local.numel(), " elements but the parameter has ", p.local.numel());
  ShardedTensor e;
  e.name = entry_name(p, key);
  e.global_shape = p.global_shape;
  e.offset = p.offset;
  e.chunk = p.chunk;
  e.local = std::move(local);
  e.primary = p.primary;
  e.is_parameter = false;
  return e;
}

// The step is one number per parameter: the rank holding element 0 of a
// non-empty parameter as primary writes it (of a tensor-parallel block, the
// block that starts the whole tensor).
ShardedTensor step_entry(const ShardedTensor& p, int64_t step) {
  ShardedTensor e;
  e.name = entry_name(p, "step");
  e.offset = 0;
  e.local = at::full({}, step, at::kLong);
  e.primary = p.primary && p.offset == 0 && p.local.numel() > 0 &&
              (p.chunk.whole() || p.chunk.ranges.front().first == 0);
  e.is_parameter = false;
  return e;
}

template <typename State>
void add_adam_entries(const ShardedTensor& p, State& st, std::vector<ShardedTensor>& out) {
  if (st.exp_avg().defined()) out.push_back(entry_like(p, "exp_avg", st.exp_avg()));
  if (st.exp_avg_sq().defined()) out.push_back(entry_like(p, "exp_avg_sq", st.exp_avg_sq()));
  if (st.max_exp_avg_sq().defined() && st.max_exp_avg_sq().numel() == p.local.numel()) {
    out.push_back(entry_like(p, "max_exp_avg_sq", st.max_exp_avg_sq()));
  }
  // A zero-element parameter has no element to hold its step (see the header).
  int64_t global_numel = 1;
  for (int64_t d : p.global_shape) global_numel *= d;
  if (global_numel > 0) out.push_back(step_entry(p, st.step()));
}

constexpr const char* kTensorKeys[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                       "momentum_buffer"};

}  // namespace

std::vector<ShardedTensor> optimizer_state(torch::optim::Optimizer& optimizer,
                                           const std::vector<ShardedTensor>& params) {
  const Kind kind = kind_of(optimizer);
  check_held(optimizer, params);
  std::vector<ShardedTensor> out;
  auto& state = optimizer.state();
  for (const auto& p : params) {
    auto it = state.find(key_of(p.local));
    if (it == state.end() || !it->second) continue;  // no step taken yet
    switch (kind) {
      case Kind::AdamW:
        add_adam_entries(p, static_cast<torch::optim::AdamWParamState&>(*it->second), out);
        break;
      case Kind::Adam:
        add_adam_entries(p, static_cast<torch::optim::AdamParamState&>(*it->second), out);
        break;
      case Kind::SGD: {
        auto& st = static_cast<torch::optim::SGDParamState&>(*it->second);
        if (st.momentum_buffer().defined()) {
          out.push_back(entry_like(p, "momentum_buffer", st.momentum_buffer()));
        }
        break;
      }
    }
  }
  return out;
}

std::vector<ShardedTensor> optimizer_state_targets(const Metadata& metadata,
                                                   const std::vector<ShardedTensor>& params) {
  std::vector<ShardedTensor> out;
  for (const auto& p : params) {
    for (const char* key : kTensorKeys) {
      if (!metadata.find_tensor(entry_name(p, key))) continue;
      // Shaped and typed like the parameter's piece: the optimizer computes
      // with it next to the parameter. global_shape is the model's, so a
      // checkpoint of another shape is reported by name.
      out.push_back(entry_like(p, key, at::zeros_like(p.local, at::MemoryFormat::Contiguous)));
    }
    if (metadata.find_tensor(entry_name(p, "step"))) {
      ShardedTensor e = step_entry(p, 0);
      e.primary = true;
      out.push_back(std::move(e));
    }
  }
  return out;
}

void set_optimizer_state(torch::optim::Optimizer& optimizer,
                         const std::vector<ShardedTensor>& params,
                         const std::vector<ShardedTensor>& entries) {
  const Kind kind = kind_of(optimizer);
  check_held(optimizer, params);
  std::unordered_map<std::string, const ShardedTensor*> by_name;
  for (const auto& e : entries) by_name[e.name] = &e;
  const auto find = [&](const ShardedTensor& p, const char* key) -> const ShardedTensor* {
    auto it = by_name.find(entry_name(p, key));
    return it == by_name.end() ? nullptr : it->second;
  };
  // A copy of the entry, in the parameter's shape, dtype and device.
  const auto state_tensor = [&](const ShardedTensor& p, const ShardedTensor& e) {
    ST_CHECK(e.local.defined() && e.local.numel() == p.local.numel() && e.offset == p.offset &&
                 e.global_shape == p.global_shape,
             CheckpointError, "optimizer state '", e.name, "' covers elements ", e.offset, " + ",
             e.local.defined() ? e.local.numel() : 0, " of shape ",
             c10::IntArrayRef(e.global_shape), " but its parameter holds ", p.offset, " + ",
             p.local.numel(), " of ", c10::IntArrayRef(p.global_shape));
    return e.local.detach().reshape(p.local.sizes()).to(p.local.options(), false, true);
  };

  // A zero-element parameter has no stored step: it takes the largest one.
  int64_t max_step = 0;
  for (const auto& p : params) {
    if (const auto* s = find(p, "step")) max_step = std::max(max_step, s->local.item<int64_t>());
  }

  at::NoGradGuard no_grad;
  auto& state = optimizer.state();
  for (const auto& p : params) {
    if (kind == Kind::SGD) {
      const auto* mb = find(p, "momentum_buffer");
      if (!mb) continue;
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(state_tensor(p, *mb));
      state[key_of(p.local)] = std::move(st);
      continue;
    }
    const auto* ea = find(p, "exp_avg");
    const auto* eas = find(p, "exp_avg_sq");
    const auto* mx = find(p, "max_exp_avg_sq");
    const auto* step = find(p, "step");
    if (!ea && !eas && !mx && !step) continue;
    ST_CHECK(ea && eas, CheckpointError, "the optimizer state of '", p.name,
             "' is incomplete: it needs both exp_avg and exp_avg_sq. Hint: the checkpoint was "
             "written by another optimizer type.");
    const int64_t step_value =
        step ? step->local.item<int64_t>() : (p.local.numel() == 0 ? max_step : 0);
    at::Tensor max_sq;
    if (mx) {
      max_sq = state_tensor(p, *mx);
    } else if (amsgrad_for(optimizer, kind, p.local)) {
      max_sq = at::zeros_like(p.local, at::MemoryFormat::Contiguous);
    }
    if (kind == Kind::AdamW) {
      auto st = std::make_unique<torch::optim::AdamWParamState>();
      st->step(step_value);
      st->exp_avg(state_tensor(p, *ea));
      st->exp_avg_sq(state_tensor(p, *eas));
      if (max_sq.defined()) st->max_exp_avg_sq(max_sq);
      state[key_of(p.local)] = std::move(st);
    } else {
      auto st = std::make_unique<torch::optim::AdamParamState>();
      st->step(step_value);
      st->exp_avg(state_tensor(p, *ea));
      st->exp_avg_sq(state_tensor(p, *eas));
      if (max_sq.defined()) st->max_exp_avg_sq(max_sq);
      state[key_of(p.local)] = std::move(st);
    }
  }
}

void load_optimizer_state(const std::string& dir, comm::Communicator& comm,
                          torch::optim::Optimizer& optimizer,
                          const std::vector<ShardedTensor>& params) {
  std::string error;
  std::vector<ShardedTensor> targets;
  try {
    kind_of(optimizer);
    check_held(optimizer, params);
    targets = optimizer_state_targets(read_metadata(dir), params);
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = detail::agree_on_error(comm, error);
  if (!error.empty()) throw CheckpointError(error);
  load_sharded(dir, comm, targets, LoadOptions().strict(false));
  try {
    set_optimizer_state(optimizer, params, targets);
  } catch (const std::exception& e) {
    error = e.what();
  }
  error = detail::agree_on_error(comm, error);
  if (!error.empty()) throw CheckpointError(error);
}

}  // namespace shardtrain::checkpoint
