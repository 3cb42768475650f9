// What every strategy shares: the same start on every rank (broadcast from
// rank 0), the model's tensors by name, dtype choice, gradient clipping, and
// the state of strategies that hold the whole model.
#include <torch/torch.h>

#include <unordered_set>

#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "strategy/detail.h"

namespace shardtrain::strategy::detail {

namespace {

bool comm_supports(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kInt:
    case at::kLong: return true;
    default: return false;
  }
}

// Dtypes the communicator cannot carry but that fit exactly in int32.
bool stage_as_int32(at::ScalarType t) {
  return t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort;
}

}  // namespace

// ---- planning ---------------------------------------------------------------------

void model_tensors(torch::nn::Module& model, std::vector<at::Tensor>& tensors,
                   std::vector<std::string>& names) {
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(true)) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
  for (const auto& item : model.named_buffers(true)) {
    if (!item.value().defined()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    names.push_back(item.key());
    tensors.push_back(item.value());
  }
}

// Broadcasts `tensors` from rank 0 in place: all issued first (they run in
// order on the comm thread), then waited. Tensors the communicator cannot
// take directly (non-contiguous, or bool/uint8/int8/int16) go through a
// contiguous staging copy; bool buffers (masks) travel as int32 0/1, which
// is exact, because Gloo and our communicator have no bool reduction type.
void broadcast_from_rank0(comm::Communicator& comm, const std::vector<at::Tensor>& tensors,
                          const std::vector<std::string>& names) {
  at::NoGradGuard no_grad;
  std::vector<comm::Work> works;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;  // (destination, staged)
  works.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor t = tensors[i].detach();
    const auto dtype = t.scalar_type();
    ST_CHECK(comm_supports(dtype) || stage_as_int32(dtype), InvalidArgument, "DDP cannot broadcast '",
             names[i], "' of dtype ", c10::toString(dtype),
             ": supported are float32/64, bfloat16, float16, int8/16/32/64, uint8 and bool; "
             "convert it or keep it out of the module's parameters and buffers");
    if (t.numel() == 0) continue;
    if (comm_supports(dtype) && t.is_contiguous()) {
      works.push_back(comm.broadcast(t, comm::BroadcastOptions().root(0).async(true)));
    } else {
      at::Tensor staged = stage_as_int32(dtype) ? t.to(at::kInt).contiguous() : t.contiguous();
      works.push_back(comm.broadcast(staged, comm::BroadcastOptions().root(0).async(true)));
      copy_back.emplace_back(t, staged);
    }
  }
  for (auto& w : works) w.wait();
  for (auto& [dst, staged] : copy_back) dst.copy_(staged);
}

NamedParams trainable_parameters(torch::nn::Module& model) {
  NamedParams out;
  std::unordered_set<const void*> seen;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = item.value();
    if (!p.requires_grad()) continue;
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;  // tied: first name wins
    out.names.push_back(item.key());
    out.tensors.push_back(p);
  }
  return out;
}

at::ScalarType scalar_type(DType dtype, at::ScalarType own) {
  switch (dtype) {
    case DType::Fp32: return at::kFloat;
    case DType::Bf16: return at::kBFloat16;
    case DType::Fp16: return at::kHalf;
    case DType::Auto: break;
  }
  return own;
}

int64_t mib_to_bytes(double mib) { return static_cast<int64_t>(mib * (1 << 20)); }

double clip_grad_norm(const std::vector<at::Tensor>& grads, double max_norm,
                      comm::Communicator* sum_over) {
  return clip_grad_norm(grads, grads, max_norm, {sum_over});
}

double clip_grad_norm(const std::vector<at::Tensor>& counted, const std::vector<at::Tensor>& scaled,
                      double max_norm, const std::vector<comm::Communicator*>& sum_over) {
  at::NoGradGuard no_grad;
  // Each gradient's norm in its own dtype (as torch does), summed in double
  // so that many parameters do not lose the small ones.
  double sum_sq = 0.0;
  for (const auto& g : counted) {
    const double n = g.norm(2).item<double>();
    sum_sq += n * n;
  }
  for (comm::Communicator* group : sum_over) {
    if (group == nullptr || group->size() <= 1) continue;
    auto t = torch::tensor({sum_sq}, torch::kDouble);
    group->all_reduce(t);
    sum_sq = t.item<double>();
  }
  const double total = std::sqrt(sum_sq);
  if (max_norm > 0.0) {
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0) {
      for (const auto& g : scaled) g.mul_(coef);
    }
  }
  return total;
}

std::vector<ShardedTensor> whole_model_state(torch::nn::Module& model, int rank) {
  std::vector<ShardedTensor> out;
  std::unordered_set<const void*> seen;
  const auto add = [&](const std::string& name, const at::Tensor& t, bool is_parameter) {
    if (!t.defined() || !seen.insert(t.unsafeGetTensorImpl()).second) return;
    ShardedTensor s;
    s.name = name;
    s.global_shape = t.sizes().vec();
    s.local = t;
    s.primary = rank == 0;
    s.is_parameter = is_parameter;
    out.push_back(std::move(s));
  };
  for (const auto& p : model.named_parameters(true)) add(p.key(), p.value(), true);
  for (const auto& b : model.named_buffers(true)) add(b.key(), b.value(), false);
  return out;
}

std::vector<ShardedTensor> whole_optimizer_parameters(torch::nn::Module& model, int rank) {
  std::vector<ShardedTensor> out;
  auto named = trainable_parameters(model);
  for (size_t i = 0; i < named.tensors.size(); ++i) {
    ShardedTensor s;
    s.name = named.names[i];
    s.global_shape = named.tensors[i].sizes().vec();
    s.local = named.tensors[i];
    s.primary = rank == 0;  // every rank holds the same: rank 0 writes it
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> whole_state_dict(torch::nn::Module& model,
                                                                 int rank) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (rank != 0) return out;
  for (const auto& p : model.named_parameters(true)) out.emplace_back(p.key(), p.value());
  for (const auto& b : model.named_buffers(true)) {
    if (b.value().defined()) out.emplace_back(b.key(), b.value());
  }
  return out;
}

std::vector<at::Tensor> defined_grads(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) {
    if (p.grad().defined()) out.push_back(p.grad());
  }
  return out;
}

}  // namespace shardtrain::strategy::detail
