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
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardtrain/config/config.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/hf_dir.h"

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

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: llama_logits DIR IN.json OUT.json\n");
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
