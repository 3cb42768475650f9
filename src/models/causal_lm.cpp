// generate(): sampling from any CausalLM, with or without its key/value cache.
#include "shardtrain/models/causal_lm.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>

#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace {

// Below this temperature sampling is greedy. logits / 1e-300 are infinite
// (the scalar is 0 in fp32) and their softmax NaN, which multinomial refused
// with an untyped error; at 1e-4 a gap of 0.01 between two logits is already
// e^100 between their probabilities, so nothing but the argmax is ever drawn.
constexpr double kGreedyBelow = 1e-4;

// logits [V] (fp32) -> the next token id, as the options say.
int64_t sample(at::Tensor logits, const GenerateOptions& o, at::Generator& gen) {
  if (o.temperature() < kGreedyBelow) return logits.argmax().item<int64_t>();
  logits = logits / o.temperature();
  const double inf = std::numeric_limits<double>::infinity();
  if (o.top_k() > 0 && o.top_k() < logits.size(0)) {
    const auto kth = std::get<0>(at::topk(logits, o.top_k())).select(0, o.top_k() - 1);
    logits = logits.masked_fill(logits < kth, -inf);
  }
  if (o.top_p() < 1.0) {
    // The most likely tokens whose probability before them is below top_p:
    // the smallest set that reaches it (the first token always stays).
    const auto sorted = at::sort(logits, /*dim=*/0, /*descending=*/true);
    const auto probs = at::softmax(std::get<0>(sorted), 0);
    const auto before = probs.cumsum(0) - probs;
    const auto drop = at::zeros_like(before, at::kBool).scatter(0, std::get<1>(sorted), before.ge(o.top_p()));
    logits = logits.masked_fill(drop, -inf);
  }
  return at::multinomial(at::softmax(logits, 0), 1, /*replacement=*/false, gen).item<int64_t>();
}

}  // namespace

std::vector<int64_t> CausalLMImpl::pipeline_unit_parameters() const {
  throw ConfigError(shardtrain::detail::str_cat("the ", name(), " model cannot be cut into pipeline stages; set "
                                    "distributed.pipeline_parallel: 1"));
}

at::Tensor CausalLMImpl::forward_units(int, int, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  pipeline_unit_parameters();  // throws
  return {};
}

void CausalLMImpl::keep_units(const std::vector<std::pair<int, int>>&) { pipeline_unit_parameters(); }

at::Tensor generate(CausalLMImpl& model, at::Tensor prompt, const GenerateOptions& o) {
  ST_CHECK(prompt.dim() == 2 && prompt.size(0) == 1 && prompt.size(1) >= 1, InvalidArgument,
           "generate expects a non-empty prompt of shape [1, T], got ", prompt.sizes(),
           "; hint: start from at least one token");
  ST_CHECK(o.max_new_tokens() >= 0, InvalidArgument, "generate: max_new_tokens=", o.max_new_tokens(),
           " must be >= 0");
  ST_CHECK(o.temperature() >= 0.0, InvalidArgument, "generate: temperature=", o.temperature(),
           " must be >= 0 (0: greedy)");
  ST_CHECK(o.top_p() > 0.0 && o.top_p() <= 1.0, InvalidArgument, "generate: top_p=", o.top_p(),
           " must be in (0, 1]");
  torch::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();  // no dropout while sampling
  at::Generator gen = at::detail::createCPUGenerator(o.seed());
  std::vector<int64_t> ids(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + prompt.size(1));
  const auto as_tensor = [&](size_t from) {
    return at::tensor(std::vector<int64_t>(ids.begin() + static_cast<long>(from), ids.end()), at::kLong)
        .view({1, -1})
        .to(prompt.device());
  };
  const size_t context = static_cast<size_t>(model.context_size());
  KVCache cache;
  size_t cached_from = 0;  // ids[cached_from..] are in the cache
  for (int64_t i = 0; i < o.max_new_tokens(); ++i) {
    at::Tensor logits;
    if (!o.use_cache()) {
      const size_t from = ids.size() > context ? ids.size() - context : 0;
      logits = model.forward(as_tensor(from));
    } else {
      if (ids.size() - cached_from > context) {  // full: start again from the last tokens
        cache = KVCache();
        cached_from = ids.size() - context;
      }
      const size_t next = cached_from + static_cast<size_t>(cache.length);
      const auto fresh = as_tensor(next);
      logits = model.forward_cached(fresh, cache);
    }
    const int64_t token = sample(logits.select(1, -1).squeeze(0).to(at::kFloat).cpu(), o, gen);
    ids.push_back(token);
    const auto& stop = o.stop_tokens();
    if (std::find(stop.begin(), stop.end(), token) != stop.end()) break;
  }
  model.train(was_training);
  return as_tensor(0);
}

}  // namespace shardtrain::models
