// Pipeline parallelism: the stage cut, the schedule executor, and the
// strategy a pipeline's ranks share.
#include "shardtrain/parallel/pipeline.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "checkpoint/detail.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/tokens.h"
#include "shardtrain/models/causal_lm.h"
#include "shardtrain/models/lora_peft.h"
#include "shardtrain/parallel/pipeline_transport.h"
#include "shardtrain/strategy/strategy.h"
#include "strategy/detail.h"

namespace shardtrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Positions [B, T] of a micro-batch: its own, else 0..T-1 in every row.
// Stages past the first need them: their input may be a sequence shard.
at::Tensor positions_of(const data::Batch& b) {
  if (b.position.defined()) return b.position;
  const int64_t rows = b.input.size(0), t = b.input.size(1);
  return at::arange(t, b.input.options().dtype(at::kLong)).unsqueeze(0).expand({rows, t});
}

// zero_bubble: keeps the gradients that reach a node during the input half.
struct KeepGrads final : torch::autograd::FunctionPreHook {
  explicit KeepGrads(std::shared_ptr<variable_list> into) : into_(std::move(into)) {}
  variable_list operator()(const variable_list& grads) override {
    *into_ = grads;
    return grads;
  }
  std::shared_ptr<variable_list> into_;
};

// zero_bubble: a node on the way to the stage's input that also feeds
// weights, what reached it, and the accumulators of those weights.
struct WeightNode {
  std::shared_ptr<Node> node;
  std::shared_ptr<variable_list> grads;
  torch::autograd::edge_list accumulators;
};

// The graph from `root` to `input`'s accumulator: the nodes on the way
// (they run in the input half) and, among them, those with edges that lead
// only to weights (run again in the weight half, for those edges alone).
class GraphSplit {
 public:
  GraphSplit(const std::shared_ptr<Node>& root, const Node* input) : input_(input) { reaches_input(root.get()); }

  // InvalidArgument when a weight is read on the way to the input twice (a
  // layer used twice in one stage): the weight half of the later read would
  // run the earlier one too, with part of its gradient.
  std::vector<WeightNode> weight_nodes() {
    std::vector<WeightNode> out;
    std::set<const Node*> claimed;
    for (Node* node : visited_) {
      if (!on_path_.at(node)) continue;
      torch::autograd::edge_list accumulators;
      for (const Edge& e : node->next_edges()) {
        if (!e.is_valid() || on_path_.at(e.function.get())) continue;
        for (const Edge& a : leaves(e.function)) accumulators.push_back(a);
      }
      if (accumulators.empty()) continue;
      // Each accumulator once per node (a weight read twice by one node).
      std::set<const Node*> seen;
      torch::autograd::edge_list unique;
      for (const Edge& a : accumulators) {
        if (!seen.insert(a.function.get()).second) continue;
        ST_CHECK(claimed.insert(a.function.get()).second, InvalidArgument,
                 "pipeline_schedule zero_bubble: a weight is read twice in one stage's forward (a layer "
                 "used twice), which its split backward cannot take apart; use 1f1b or interleaved_1f1b");
        unique.push_back(a);
      }
      out.push_back({node->shared_from_this(), std::make_shared<variable_list>(), std::move(unique)});
    }
    return out;
  }

 private:
  bool reaches_input(Node* node) {
    const auto it = on_path_.find(node);
    if (it != on_path_.end()) return it->second;
    on_path_[node] = false;  // a graph has no cycles; this only marks the visit
    visited_.push_back(node);
    bool reaches = node == input_;
    for (const Edge& e : node->next_edges()) {
      if (e.is_valid() && reaches_input(e.function.get())) reaches = true;
    }
    on_path_[node] = reaches;
    return reaches;
  }

  // The leaf accumulators below `node` (which does not reach the input).
  const torch::autograd::edge_list& leaves(const std::shared_ptr<Node>& node) {
    const auto it = leaves_.find(node.get());
    if (it != leaves_.end()) return it->second;
    torch::autograd::edge_list out;
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node.get()) != nullptr) {
      out.emplace_back(node, 0);  // a weight
    } else {
      for (const Edge& e : node->next_edges()) {
        if (!e.is_valid()) continue;
        for (const Edge& a : leaves(e.function)) out.push_back(a);
      }
    }
    return leaves_[node.get()] = std::move(out);
  }

  const Node* input_;
  std::vector<Node*> visited_;  // in the order first reached: the weight half runs in a fixed order
  std::unordered_map<Node*, bool> on_path_;
  std::unordered_map<Node*, torch::autograd::edge_list> leaves_;
};

// One micro-batch on one stage, from its forward to its last backward work.
struct Live {
  at::Tensor input;   // the received activation (a leaf), undefined on the first stage
  at::Tensor output;  // what backward starts from: the loss root (last stage) or the activation sent
  at::Tensor output_grad;  // the next stage's gradient of `output` (undefined on the last stage)
  std::vector<WeightNode> weight_nodes;  // zero_bubble, after the input half
};

// The step's last weight work synchronises gradients over the
// data-parallel ranks; whatever another of this rank's stages
// accumulated earlier is reduced with it (finish_gradient_sync).
int last_weight_work_of(const std::vector<PipeAction>& actions) {
  int last_weight_work = -1;
  for (size_t i = 0; i < actions.size(); ++i) {
    if (actions[i].op != PipeOp::Forward && actions[i].op != PipeOp::BackwardInput) last_weight_work = static_cast<int>(i);
  }
  return last_weight_work;
}

// zero_bubble's input half on a stage past the first: the gradient of the
// stage's input alone, keeping what reaches the nodes that also feed weights.
at::Tensor backward_input(Live& l, torch::autograd::Engine& engine) {
  const Edge input = torch::autograd::impl::gradient_edge(l.input);
  const Edge root = torch::autograd::impl::gradient_edge(l.output);
  GraphSplit split(root.function, input.function.get());
  l.weight_nodes = split.weight_nodes();
  for (WeightNode& w : l.weight_nodes) w.node->add_pre_hook(std::make_unique<KeepGrads>(w.grads));
  const variable_list root_grad{l.output_grad.defined() ? l.output_grad : at::ones_like(l.output)};
  return engine.execute({root}, root_grad, /*keep_graph=*/true, /*create_graph=*/false,
                        /*accumulate_grad=*/false, {input})[0];
}

// zero_bubble's weight half on a stage past the first: each node again, for
// its weights alone, from what reached it; then each weight's sum through its
// accumulator (and the hooks of the data-parallel strategy on it).
void backward_weight(const Live& l, torch::autograd::Engine& engine) {
  std::vector<std::pair<Edge, at::Tensor>> sums;
  std::unordered_map<const Node*, size_t> index;
  for (const WeightNode& w : l.weight_nodes) {
    torch::autograd::edge_list roots;
    variable_list grads;
    for (size_t k = 0; k < w.grads->size(); ++k) {
      if (!(*w.grads)[k].defined()) continue;
      roots.emplace_back(w.node, static_cast<uint32_t>(k));
      grads.push_back((*w.grads)[k]);
    }
    if (roots.empty()) continue;
    const variable_list got = engine.execute(roots, grads, /*keep_graph=*/true, /*create_graph=*/false,
                                             /*accumulate_grad=*/false, w.accumulators);
    for (size_t k = 0; k < got.size(); ++k) {
      if (!got[k].defined()) continue;
      const Node* acc = w.accumulators[k].function.get();
      const auto it = index.find(acc);
      if (it == index.end()) {
        index[acc] = sums.size();
        sums.emplace_back(w.accumulators[k], got[k]);
      } else {
        sums[it->second].second = sums[it->second].second + got[k];
      }
    }
  }
  // One pass for all of them: the strategy sees one backward.
  torch::autograd::edge_list accumulators;
  variable_list grads;
  for (const auto& [acc, g] : sums) {
    accumulators.push_back(acc);
    grads.push_back(g);
  }
  if (!accumulators.empty()) {
    engine.execute(accumulators, grads, /*keep_graph=*/false, /*create_graph=*/false,
                   /*accumulate_grad=*/true);
  }
}

// An action's span on the step's clock (t0), from its start to now.
void record_span(PipelineStepStats& stats, const PipeAction& a, Clock::time_point t0, Clock::time_point start) {
  const double end_s = seconds_since(t0);
  const double start_s = std::chrono::duration<double>(start - t0).count();
  stats.busy_s += end_s - start_s;
  stats.spans.push_back({a, start_s, end_s});
}

}  // namespace

struct Pipeline::Impl {
  models::CausalLMImpl* model = nullptr;
  std::shared_ptr<comm::Communicator> pp, tp;
  // Activations go down (rank r to r + 1), gradients up; the last rank
  // reaches the first (interleaved) on a link of its own each way.
  std::shared_ptr<comm::Communicator> down, up, wrap_down, wrap_up, ends;
  PipelineOptions options;
  int ranks = 1, rank = 0, v = 1;
  std::vector<StageRange> stages;
  std::vector<std::string> tied;
  // The schedule of the last window size run, per rank.
  int scheduled_for = -1;
  std::vector<PipeAction> actions;

  int num_stages() const { return static_cast<int>(stages.size()); }
  bool last(int s) const { return s == num_stages() - 1; }
  std::pair<int, int> unit_range(int s) const {
    return {stages[static_cast<size_t>(s)].first, stages[static_cast<size_t>(s)].end};
  }

  // The link and peer that carry stage s's activation to s + 1, and s's
  // gradient to s - 1.
  std::pair<comm::Communicator*, int> to_next(int s) const {
    return rank == ranks - 1 ? std::make_pair(wrap_down.get(), 0) : std::make_pair(down.get(), rank + 1);
  }
  std::pair<comm::Communicator*, int> from_previous(int s) const {
    return rank == 0 ? std::make_pair(wrap_down.get(), 1) : std::make_pair(down.get(), rank - 1);
  }
  std::pair<comm::Communicator*, int> to_previous(int s) const {
    return rank == 0 ? std::make_pair(wrap_up.get(), 1) : std::make_pair(up.get(), rank - 1);
  }
  std::pair<comm::Communicator*, int> from_next(int s) const {
    return rank == ranks - 1 ? std::make_pair(wrap_up.get(), 0) : std::make_pair(up.get(), rank + 1);
  }
  uint32_t tag(int s, int micro, int micro_batches) const {
    return static_cast<uint32_t>(s * micro_batches + micro);
  }

  // What action `a` waits for: a forward past the first stage, the previous
  // stage's activation; a backward before the last, the next stage's gradient.
  void receive(const PipeAction& a, Live& l, int micro_batches) const {
    const int s = a.stage;
    if (a.op == PipeOp::Forward && s > 0) {
      const auto [link, peer] = from_previous(s);
      l.input = recv_from_stage(*link, peer, tag(s, a.micro, micro_batches)).requires_grad_(true);
    }
    if ((a.op == PipeOp::Backward || a.op == PipeOp::BackwardInput) && !last(s)) {
      const auto [link, peer] = from_next(s);
      l.output_grad = recv_from_stage(*link, peer, tag(s, a.micro, micro_batches));
    }
  }

  // What action `a` computed, on to the next stage (forward) or the previous one (backward).
  StageSend send(const PipeAction& a, const at::Tensor& to_send, int micro_batches) const {
    const int s = a.stage;
    const bool forward = a.op == PipeOp::Forward;
    const auto [link, peer] = forward ? to_next(s) : to_previous(s);
    return send_to_stage(*link, to_send, peer, tag(forward ? s + 1 : s - 1, a.micro, micro_batches));
  }

  at::Tensor forward(int s, const at::Tensor& input, const data::Batch& b, const PipelineStepFns& fns) {
    const auto [first, end] = unit_range(s);
    const at::Tensor position = positions_of(b);
    return fns.in_precision([&] { return model->forward_units(first, end, input, position, b.segment); });
  }

  const std::vector<PipeAction>& schedule_for(int micro_batches) {
    if (scheduled_for != micro_batches) {
      actions = pipeline_schedule(options.schedule(), ranks, micro_batches, v)[static_cast<size_t>(rank)];
      scheduled_for = micro_batches;
    }
    return actions;
  }
};

Pipeline::Pipeline(models::CausalLMImpl& model, const comm::DeviceMesh& mesh, const PipelineOptions& options)
    : impl_(std::make_shared<Impl>()) {
  Impl& d = *impl_;
  d.model = &model;
  d.pp = mesh.pp();
  d.tp = mesh.tp();
  d.options = options;
  d.ranks = d.pp->size();
  d.rank = d.pp->rank();
  d.v = options.schedule() == PipelineSchedule::Interleaved1F1B ? options.stages_per_rank() : 1;
  ST_CHECK(d.ranks >= 2, ConfigError, "a pipeline needs distributed.pipeline_parallel >= 2, got ", d.ranks);
  d.stages = split_stages(model.pipeline_unit_parameters(), d.ranks * d.v, options.split());
  std::vector<std::pair<int, int>> keep;
  for (int s : local_stages()) keep.push_back(d.unit_range(s));
  model.keep_units(keep);

  // A tied head: the parameters both ends hold (no decoder layer is on two
  // stages, so only a weight the head shares with the embedding can be).
  std::string mine;
  for (const auto& p : model.named_parameters()) mine += p.key() + "\n";
  const std::vector<std::string> all = checkpoint::detail::all_gather_strings(*d.pp, mine);
  const auto names_of = [](const std::string& text) {
    std::set<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.insert(line);
    return out;
  };
  const std::set<std::string> first = names_of(all.front()), final_stage = names_of(all.back());
  std::set_intersection(first.begin(), first.end(), final_stage.begin(), final_stage.end(),
                        std::back_inserter(d.tied));

  // The links, made in the same order on every rank.
  std::vector<int> everyone(static_cast<size_t>(d.ranks));
  for (int r = 0; r < d.ranks; ++r) everyone[static_cast<size_t>(r)] = r;
  d.down = d.pp->new_group(everyone);
  d.up = d.pp->new_group(everyone);
  if (d.v > 1) {
    d.wrap_down = d.pp->new_group({0, d.ranks - 1});
    d.wrap_up = d.pp->new_group({0, d.ranks - 1});
  }
  if (!d.tied.empty()) d.ends = d.pp->new_group({0, d.ranks - 1});
}

Pipeline::~Pipeline() = default;

const std::vector<StageRange>& Pipeline::stages() const { return impl_->stages; }

std::vector<int> Pipeline::local_stages() const {
  return rank_stages(impl_->rank, impl_->ranks, impl_->num_stages());
}

std::vector<int> rank_stages(int rank, int ranks, int stages) {
  std::vector<int> out;
  for (int s = rank; s < stages; s += ranks) out.push_back(s);
  return out;
}

const std::vector<std::string>& Pipeline::tied_names() const { return impl_->tied; }

PipelineStepStats Pipeline::run_step(const std::vector<data::Batch>& window, const PipelineStepFns& fns) {
  Impl& d = *impl_;
  const int m = static_cast<int>(window.size());
  const std::vector<PipeAction>& actions = d.schedule_for(m);
  const int last_weight_work = last_weight_work_of(actions);

  PipelineStepStats stats;
  const auto t0 = Clock::now();
  std::map<std::pair<int, int>, Live> live;
  std::vector<StageSend> sends;
  auto& engine = torch::autograd::Engine::get_default_engine();
  for (size_t i = 0; i < actions.size(); ++i) {
    const PipeAction& a = actions[i];
    const data::Batch& b = window[static_cast<size_t>(a.micro)];
    const int s = a.stage;
    Live& l = live[{s, a.micro}];
    // Receive first (waiting is not work), then compute.
    d.receive(a, l, m);
    const auto start = Clock::now();
    at::Tensor to_send;  // to the next stage (forward) or the previous one (backward)
    switch (a.op) {
      case PipeOp::Forward: {
        const at::Tensor out = d.forward(s, s == 0 ? b.input : l.input, b, fns);
        if (d.last(s)) {
          const at::Tensor loss = fns.loss_sum(out, b);
          stats.loss_sum += loss.item<double>();
          l.output = fns.backward_root(loss);
        } else {
          l.output = out;
          to_send = out.detach();
        }
        break;
      }
      case PipeOp::Backward: {
        fns.set_gradient_sync(static_cast<int>(i) == last_weight_work);
        torch::autograd::backward({l.output}, {l.output_grad});
        if (s > 0) to_send = l.input.grad();
        live.erase({s, a.micro});
        break;
      }
      case PipeOp::BackwardInput: {
        if (s == 0) break;  // nothing to send back: the whole backward is weight work
        to_send = backward_input(l, engine);
        break;
      }
      case PipeOp::BackwardWeight: {
        fns.set_gradient_sync(static_cast<int>(i) == last_weight_work);
        if (s == 0) {
          torch::autograd::backward({l.output}, {l.output_grad});
        } else {
          backward_weight(l, engine);
        }
        live.erase({s, a.micro});
        break;
      }
    }
    record_span(stats, a, t0, start);
    if (to_send.defined()) sends.push_back(d.send(a, to_send, m));
  }
  for (StageSend& send : sends) send.wait();
  stats.span_s = seconds_since(t0);
  return stats;
}

double Pipeline::evaluate(const data::Batch& batch, const PipelineStepFns& fns) {
  Impl& d = *impl_;
  at::NoGradGuard no_grad;
  double loss = 0.0;
  std::vector<StageSend> sends;
  for (int s : local_stages()) {
    at::Tensor input = batch.input;
    if (s > 0) {
      const auto [link, peer] = d.from_previous(s);
      input = recv_from_stage(*link, peer, d.tag(s, 0, 1));
    }
    const at::Tensor out = d.forward(s, input, batch, fns);
    if (d.last(s)) {
      loss += fns.loss_sum(out, batch).item<double>();
    } else {
      const auto [link, peer] = d.to_next(s);
      sends.push_back(send_to_stage(*link, out, peer, d.tag(s + 1, 0, 1)));
    }
  }
  for (StageSend& send : sends) send.wait();
  return loss;
}

double measured_bubble(const std::vector<double>& busy_s, double span_s) {
  double busy = 0.0, idle = 0.0;
  for (double b : busy_s) {
    busy += b;
    idle += std::max(0.0, span_s - b);
  }
  return busy > 0.0 ? idle / busy : 0.0;
}

// ---- the strategy ---------------------------------------------------------------------------

namespace {

using strategy::ShardedTensor;

class PipelineStrategy final : public strategy::Strategy {
 public:
  PipelineStrategy(std::unique_ptr<Strategy> inner, std::shared_ptr<Pipeline::Impl> pipe)
      : inner_(std::move(inner)), pipe_(std::move(pipe)) {}

  void setup(torch::nn::Module& model, std::shared_ptr<comm::Communicator> comm) override {
    throw InvalidArgument("a pipeline's strategy is set up on the device mesh: call setup(model, mesh)");
  }
  void setup(torch::nn::Module& model, const comm::DeviceMesh& mesh) override {
    ST_CHECK(mesh.pp() == pipe_->pp, InvalidArgument, "setup: the mesh's pp group is not the one the model was cut over");
    inner_->setup(model, mesh);
  }
  void set_gradient_sync(bool enabled) override { inner_->set_gradient_sync(enabled); }
  void keep_gathered_in_step(bool keep) override { inner_->keep_gathered_in_step(keep); }

  // A tied head's gradient: each end holds its part (the embedding's, the
  // head's); both take the sum. A sharded strategy holds a slice of it on
  // each rank, not the same slice at both ends (their flat layouts differ),
  // so the whole gradient is made first.
  void finish_gradient_sync() override {
    inner_->finish_gradient_sync();
    if (pipe_->ends == nullptr) return;
    at::NoGradGuard no_grad;
    for (ShardedTensor& t : tied_parameters()) {
      at::Tensor& grad = t.local.mutable_grad();
      if (!grad.defined()) grad = at::zeros_like(t.local);
      const int64_t whole = c10::multiply_integers(t.chunk.whole() ? t.global_shape : t.chunk.shape(t.global_shape));
      at::Tensor full = at::zeros({whole}, grad.options().dtype(at::kFloat));
      full.narrow(0, t.offset, grad.numel()).copy_(grad.reshape({-1}));
      if (comm::Communicator* shards = inner_->optimizer_shard_group()) shards->all_reduce(full);
      pipe_->ends->all_reduce(full);
      grad.copy_(full.narrow(0, t.offset, grad.numel()).view(grad.sizes()));
    }
  }

  std::vector<ShardedTensor> optimizer_parameters() override { return saved_once(inner_->optimizer_parameters()); }
  std::vector<at::Tensor> gradients() override { return inner_->gradients(); }

  // Every stage's norm, each parameter once: a tied one is the first stage's.
  double clip_grad_norm(double max_norm) override {
    const double stage = inner_->clip_grad_norm(0.0);
    double sum_sq = stage * stage;
    if (pipe_->ends != nullptr && pipe_->rank != 0) {
      for (ShardedTensor& t : tied_parameters()) {
        if (!t.local.grad().defined()) continue;
        auto sq = at::full({1}, t.local.grad().to(at::kDouble).pow(2).sum().item<double>(), at::kDouble);
        if (comm::Communicator* shards = inner_->optimizer_shard_group()) shards->all_reduce(sq);
        if (!t.chunk.whole()) pipe_->tp->all_reduce(sq);
        sum_sq -= sq.item<double>();
      }
    }
    auto total = at::full({1}, std::max(0.0, sum_sq), at::kDouble);
    pipe_->pp->all_reduce(total);
    const double norm = std::sqrt(total.item<double>());
    if (max_norm > 0.0) {
      const double coef = max_norm / (norm + 1e-6);
      if (coef < 1.0) {
        at::NoGradGuard no_grad;
        for (const at::Tensor& g : inner_->gradients()) g.mul_(coef);
      }
    }
    return norm;
  }

  void optimizer_step(torch::optim::Optimizer& optimizer) override { inner_->optimizer_step(optimizer); }

  std::vector<ShardedTensor> sharded_state_dict() override { return saved_once(inner_->sharded_state_dict()); }

  // Each stage's whole tensors (on its first data-parallel rank) to the
  // pipeline's first rank, stage by stage; a tied copy once.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict() override {
    // A quantized LoRA base travels as the weight it stands for.
    std::vector<std::pair<std::string, at::Tensor>> out = models::dequantize_lora_bases(inner_->full_state_dict());
    comm::Communicator& pp = *pipe_->pp;
    if (pp.rank() != 0) {
      std::vector<StageSend> sends;
      sends.push_back(send_to_stage(pp, at::full({1}, static_cast<int64_t>(out.size()), at::kLong), 0, 0));
      uint32_t tag = 1;
      for (const auto& [name, t] : out) {
        at::Tensor codes = at::empty({static_cast<int64_t>(name.size())}, at::kInt);
        for (size_t i = 0; i < name.size(); ++i) codes[static_cast<int64_t>(i)] = static_cast<int>(static_cast<unsigned char>(name[i]));
        sends.push_back(send_to_stage(pp, codes, 0, tag++));
        sends.push_back(send_to_stage(pp, t, 0, tag++));
      }
      for (StageSend& s : sends) s.wait();
      return {};
    }
    std::set<std::string> have;
    for (const auto& kv : out) have.insert(kv.first);
    for (int r = 1; r < pp.size(); ++r) {
      const int64_t count = recv_from_stage(pp, r, 0).item<int64_t>();
      uint32_t tag = 1;
      for (int64_t i = 0; i < count; ++i) {
        const at::Tensor codes = recv_from_stage(pp, r, tag++);
        std::string name(static_cast<size_t>(codes.numel()), ' ');
        for (int64_t k = 0; k < codes.numel(); ++k) name[static_cast<size_t>(k)] = static_cast<char>(codes[k].item<int>());
        at::Tensor t = recv_from_stage(pp, r, tag++);
        if (have.insert(name).second) out.emplace_back(std::move(name), std::move(t));
      }
    }
    return out;
  }

  void reload_parameters() override { inner_->reload_parameters(); }
  std::string name() const override { return inner_->name() + "+pp" + std::to_string(pipe_->ranks); }
  int64_t gradient_collectives() const override { return inner_->gradient_collectives(); }
  strategy::CommStats comm_stats() const override { return inner_->comm_stats(); }
  comm::Communicator* optimizer_shard_group() const override { return inner_->optimizer_shard_group(); }

 private:
  // A tied copy (and its optimizer state) is written by the first stage.
  std::vector<ShardedTensor> saved_once(std::vector<ShardedTensor> tensors) const {
    if (pipe_->rank == 0) return tensors;
    for (ShardedTensor& t : tensors) {
      if (std::find(pipe_->tied.begin(), pipe_->tied.end(), t.name) != pipe_->tied.end()) t.primary = false;
    }
    return tensors;
  }

  std::vector<ShardedTensor> tied_parameters() {
    std::vector<ShardedTensor> out;
    for (ShardedTensor& t : inner_->optimizer_parameters()) {
      if (std::find(pipe_->tied.begin(), pipe_->tied.end(), t.name) != pipe_->tied.end()) out.push_back(std::move(t));
    }
    return out;
  }

  std::unique_ptr<Strategy> inner_;
  std::shared_ptr<Pipeline::Impl> pipe_;
};

}  // namespace

std::unique_ptr<strategy::Strategy> Pipeline::wrap(std::unique_ptr<strategy::Strategy> inner) {
  ST_CHECK(inner != nullptr, InvalidArgument, "Pipeline::wrap needs a strategy");
  return std::make_unique<PipelineStrategy>(std::move(inner), impl_);
}

}  // namespace shardtrain::parallel
