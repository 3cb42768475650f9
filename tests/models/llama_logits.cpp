// Logits of a Hugging Face model directory as shardtrain computes them, for
// tests/models/llama_parity.py to compare with the independent reference
// (tests/reference/llama_ref.py):
//
//   llama_logits DIR IN.json OUT.json
//
// IN.json: {"tokens": [[...]], "positions": [[...]]?, "segments": [[...]]?}.
// OUT.json: {"logits": [B][T][V] of one forward with the given positions and
// segments, "cached": [T][V] of row 0 fed one token at a time through the
// key/value cache (positions 0..T-1)}.
//
//   llama_logits batches CONFIG STEPS OUT.json [KEY=VALUE ...]
//
// The micro-batches of steps 0..STEPS-1 as the trainer's task serves them to
// one process for CONFIG with the overrides (packed rows with their
// positions and segments, masked targets), as the reference's `train
// --batches` reads them: [[{"input", "target", "position", "segment"}, ...]].
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardtrain/config/config.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"
#include "shardtrain/train/task.h"

namespace st = shardtrain;

namespace {

at::Tensor rows(const nlohmann::json& j) {
  std::vector<int64_t> flat;
  for (const auto& row : j) {
    for (const auto& v : row) flat.push_back(v.get<int64_t>());
  }
  return torch::tensor(flat, torch::kInt64).view({static_cast<int64_t>(j.size()), -1});
}

nlohmann::json to_json(const at::Tensor& t) {
  const at::Tensor c = t.contiguous().to(torch::kFloat64);
  if (c.dim() == 1) return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  nlohmann::json out = nlohmann::json::array();
  for (int64_t i = 0; i < c.size(0); ++i) out.push_back(to_json(c[i]));
  return out;
}

nlohmann::json int_rows(const at::Tensor& t) {
  if (!t.defined()) return nullptr;
  nlohmann::json out = nlohmann::json::array();
  const at::Tensor c = t.contiguous().to(torch::kInt64);
  for (int64_t i = 0; i < c.size(0); ++i) {
    out.push_back(std::vector<int64_t>(c[i].data_ptr<int64_t>(), c[i].data_ptr<int64_t>() + c.size(1)));
  }
  return out;
}

int dump_batches(int argc, char** argv) {
  std::vector<std::string> overrides(argv + 5, argv + argc);
  const st::config::Config config = st::config::Config::load(argv[2], overrides);
  const st::train::TrainTask task = st::train::make_task(config, 1);
  const st::config::BatchPlan plan = config.resolve_batch(1);
  nlohmann::json steps = nlohmann::json::array();
  for (int64_t step = 0; step < std::stoll(argv[3]); ++step) {
    nlohmann::json micro = nlohmann::json::array();
    for (int64_t m = 0; m < plan.accumulate; ++m) {
      const st::data::Batch b = task.train_batch(step, m, plan.micro, 0, 1);
      micro.push_back({{"input", int_rows(b.input)}, {"target", int_rows(b.target)},
                       {"position", int_rows(b.position)}, {"segment", int_rows(b.segment)}});
    }
    steps.push_back(micro);
  }
  std::ofstream(argv[4]) << steps.dump();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 5 && std::string(argv[1]) == "batches") {
    try {
      return dump_batches(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "llama_logits batches: %s\n", e.what());
      return 1;
    }
  }
  if (argc != 4) {
    std::fprintf(stderr, "usage: llama_logits DIR IN.json OUT.json | batches CONFIG STEPS OUT.json [KEY=VALUE ...]\n");
    return 2;
  }
  try {
    torch::set_num_threads(1);
    st::config::Config config = st::config::Config::parse("model: {type: auto, block_size: 1}\n",
                                                          {std::string("model.init_from=") + argv[1]});
    config.model.block_size = std::max<int64_t>(1, config.model.max_position_embeddings);
    const auto& family = st::models::family_of(config.model.type);
    auto model = std::dynamic_pointer_cast<st::models::CausalLMImpl>(family.build(config.model));
    st::models::load_hf_weights(*model, std::make_shared<const st::models::HfWeights>(argv[1]), family);
    model->eval();
    torch::NoGradGuard no_grad;

    nlohmann::json in;
    std::ifstream(argv[2]) >> in;
    const at::Tensor idx = rows(in.at("tokens"));
    const at::Tensor position = in.contains("positions") ? rows(in["positions"]) : at::Tensor();
    const at::Tensor segment = in.contains("segments") ? rows(in["segments"]) : at::Tensor();
    nlohmann::json out;
    out["logits"] = to_json(model->forward(idx, position, segment));
    st::models::KVCache cache;
    std::vector<at::Tensor> steps;
    for (int64_t t = 0; t < idx.size(1); ++t) {
      steps.push_back(model->forward_cached(idx.slice(0, 0, 1).slice(1, t, t + 1), cache)[0][0]);
    }
    out["cached"] = to_json(torch::stack(steps));
    std::ofstream(argv[3]) << out.dump();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llama_logits: %s\n", e.what());
    return 1;
  }
}
