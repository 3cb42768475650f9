// Pipeline parallelism: a language model cut into contiguous stages over
// the mesh's pp ranks, each rank building only its stages, and the
// executor that runs a step's micro-batches through them in a schedule's
// order (parallel/pipeline_schedule.h).
//
//   Pipeline pipe(model, mesh, PipelineOptions().schedule(PipelineSchedule::OneFOneB));
//   strategy = pipe.wrap(std::move(strategy));   // tied head, norms over stages
//   strategy->setup(model, mesh);
//   per step:  stats = pipe.run_step(window, fns);  then finish_gradient_sync, clip, step
//
// Every rank of a stage's data-parallel group reads the same micro-batches
// as the others of its pipeline (the first stage needs the token ids, the
// last the targets, all of them the positions), so only activations and
// their gradients travel: forward from stage s to s + 1, backward the other
// way (parallel/pipeline_transport.h), each with its shape. A stage's
// gradients accumulate over the micro-batches; the last weight work of the
// step synchronises them over the data-parallel ranks.
//
// zero_bubble splits each backward. Its input half asks autograd for the
// gradient of the stage's input alone, so no weight gradient is computed;
// hooks on the nodes that feed a weight keep the gradient that reached
// them. The weight half later runs each such node for its weights only,
// from what was kept, and hands the sums to the parameters' accumulators
// (where the data-parallel strategy's hooks see them). The first stage,
// which has no input gradient to send, does its whole backward as weight work.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shardtrain/core/options.h"
#include "shardtrain/parallel/pipeline_schedule.h"

namespace shardtrain {
namespace comm {
class DeviceMesh;
}
namespace data {
struct Batch;
}
namespace models {
class CausalLMImpl;
}
namespace strategy {
class Strategy;
}
}  // namespace shardtrain

namespace shardtrain::parallel {

struct PipelineOptions {
  ST_ARG(PipelineSchedule, schedule) = PipelineSchedule::OneFOneB;
  /// Stages per rank (interleaved_1f1b only; 1 otherwise).
  ST_ARG(int, stages_per_rank) = 1;
  /// distributed.pipeline_split: the first layer of each stage after the first.
  ST_ARG(std::vector<int64_t>, split) = {};
};

/// What a step's work needs from the trainer.
struct PipelineStepFns {
  /// Summed loss of a micro-batch from the last stage's logits.
  std::function<at::Tensor(const at::Tensor& logits, const data::Batch&)> loss_sum;
  /// Runs a stage's forward in the trainer's precision (autocast).
  std::function<at::Tensor(const std::function<at::Tensor()>&)> in_precision;
  /// What backward starts from, given a micro-batch's summed loss: the loss
  /// normalised by the window's targets and scaled (fp16).
  std::function<at::Tensor(const at::Tensor& loss_sum)> backward_root;
  /// Whether the next backward work synchronises gradients over data-parallel ranks.
  std::function<void(bool)> set_gradient_sync;
};

/// One rank's account of a step.
struct PipelineStepStats {
  /// Summed loss of the micro-batches whose last stage is on this rank (0 elsewhere).
  double loss_sum = 0.0;
  /// Seconds computing (forward and backward work), and from the first
  /// work's start to the last's end (computing and waiting for neighbours).
  double busy_s = 0.0;
  double span_s = 0.0;
  /// Each piece of work and when it ran, in seconds from the step's start.
  struct Span {
    PipeAction action;
    double start_s = 0.0, end_s = 0.0;
  };
  std::vector<Span> spans;
};

class Pipeline {
 public:
  /// Collective over mesh.pp(): cuts `model` into pp x stages_per_rank
  /// stages (split_stages over its units' parameter counts, or `split`),
  /// keeps this rank's stages and drops the rest (CausalLMImpl::keep_units),
  /// and makes the pipeline's links: one communicator per direction, one per
  /// direction of the link from the last rank back to the first
  /// (interleaved), and the first and last ranks' group for a tied head.
  /// ConfigError for a family that cannot be cut, a schedule that cannot run
  /// the stages, or a split that does not fit the model.
  Pipeline(models::CausalLMImpl& model, const comm::DeviceMesh& mesh, const PipelineOptions& options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  /// Every stage's units, in order.
  const std::vector<StageRange>& stages() const;
  /// The stages this rank holds.
  std::vector<int> local_stages() const;
  /// Names of the parameters both the first and the last stage hold (a tied head).
  const std::vector<std::string>& tied_names() const;

  /// Forward and backward of the window's micro-batches on this rank's
  /// stages, in the schedule's order; gradients accumulate into the
  /// parameters, and the step's last weight work (interleaved: a call after
  /// all of them) has gradient sync on. `window.size()` must be the same on
  /// every rank of the pipeline; fewer micro-batches than ranks run (with a
  /// larger bubble). CommError when a neighbour fails or leaves within the
  /// communicator's deadline.
  PipelineStepStats run_step(const std::vector<data::Batch>& window, const PipelineStepFns& fns);

  /// Forward only (evaluation, no grad): the summed loss of `batch` on the
  /// rank of the last stage, 0 on the others.
  double evaluate(const data::Batch& batch, const PipelineStepFns& fns);

  /// The data-parallel strategy of this rank's stages seen as one model:
  /// a tied head's gradient summed over its two stages (one all-reduce),
  /// the gradient norm over every stage (each parameter once), a tied
  /// copy saved by the first stage only, and the whole model on rank 0.
  std::unique_ptr<strategy::Strategy> wrap(std::unique_ptr<strategy::Strategy> inner);

  struct Impl;  // the stages and links, shared with the strategy wrap() makes

 private:
  std::shared_ptr<Impl> impl_;
};

/// The stages pipeline rank `rank` of `ranks` holds when the model is cut
/// into `stages`: rank, rank + ranks, ... (stage_rank's inverse).
std::vector<int> rank_stages(int rank, int ranks, int stages);

/// The bubble of a step as simulate() defines it, from each rank's busy
/// time and the step's span: the ranks' idle time over their busy time.
double measured_bubble(const std::vector<double>& busy_s, double span_s);

}  // namespace shardtrain::parallel
