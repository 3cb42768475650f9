// The trainer's sharded checkpoints: what a save holds besides the model and
// optimizer shards, and where resume finds it.
//
// A checkpoint of step s holds everything the loop needs to run step s+1 as
// an uninterrupted run would: parameters and optimizer state (sharded, any
// world size), the step (the data order, the learning rate and the epoch are
// pure functions of it), the loss scaler, each rank's RNG state, the best
// monitored value, and the config.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>

#include "core/json.h"
#include "train/balance.h"
#include "shardtrain/checkpoint/checkpoint.h"
#include "shardtrain/checkpoint/optimizer_state.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/core/error.h"
#include "shardtrain/precision/precision.h"
#include "shardtrain/strategy/strategy.h"
#include "shardtrain/train/trainer.h"
#include "train/lora.h"

namespace shardtrain::train {

namespace fs = std::filesystem;
namespace ck = ::shardtrain::checkpoint;

namespace {

constexpr int kTrainStateFormat = 1;

std::string rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  const at::Tensor state = gen.get_state();
  return std::string(static_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.nbytes()));
}

void set_rng_state(const std::string& bytes) {
  auto state = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
  std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace

std::string Trainer::save_checkpoint() {
  const std::string dir = ck::checkpoint_dir(config_.run.dir, state_.step);
  std::vector<strategy::ShardedTensor> tensors = strategy_->sharded_state_dict();
  if (reference_base_) detail::drop_frozen(frozen_names_, tensors);  // the base stays in model.init_from
  for (auto& e : ck::optimizer_state(*optimizer_, strategy_->optimizer_parameters())) {
    tensors.push_back(std::move(e));
  }
  // Only rank 0's blob is kept; building it everywhere keeps the code simple.
  nlohmann::json state;
  state["format"] = kTrainStateFormat;
  state["step"] = state_.step;
  state["epoch"] = state_.epoch;
  state["world_size"] = comm_->size();
  // The data order and the learning rate are functions of the step; these
  // say so explicitly for readers of the checkpoint.
  state["sampler"] = {{"seed", config_.run.seed}, {"position", state_.step}};
  state["lr_schedule"] = {{"name", enum_name(config_.schedule.name)}, {"step", state_.step}, {"lr", state_.lr}};
  state["strategy"] = strategy_->name();
  if (const auto* scaler = precision_->scaler()) {
    const auto& s = scaler->state();
    state["loss_scaler"] = {{"scale", s.scale},
                            {"iteration", s.iteration},
                            {"last_overflow_iteration", s.last_overflow_iteration},
                            {"hysteresis_left", s.hysteresis_left},
                            {"skips_at_min", s.skips_at_min},
                            {"skipped_steps", s.skipped_steps}};
  }
  if (best_step_ >= 0) {
    state["best"] = {{"monitor", config_.checkpoint.monitor}, {"value", best_value_}, {"step", best_step_}};
  }
  // Measured shares, so that a resumed run computes the same batches on
  // the same ranks (the losses do not depend on them beyond fp32 order).
  if (config_.distributed.load_balance() == LoadBalance::Measured) {
    state["load_balance"] = nlohmann::json::parse(balance_->to_json());
  }
  state["config"] = config_.to_yaml();
  if (reference_base_) state[detail::kBaseKey] = nlohmann::json::parse(base_identity_);
  ck::save_sharded(dir, *comm_, tensors, state.dump(), rng_state(),
                   ck::SaveOptions().strategy(strategy_->name()).step(state_.step));
  last_save_ = std::chrono::steady_clock::now();
  if (comm_->rank() == 0 && config_.checkpoint.keep > 0) {
    std::vector<std::string> protect;
    if (best_step_ >= 0) protect.push_back(ck::checkpoint_dir(config_.run.dir, best_step_));
    try {
      ck::prune(config_.run.dir, static_cast<int>(config_.checkpoint.keep), protect);
    } catch (const std::exception& e) {
      // Old checkpoints left behind cost disk, not the run.
      std::fprintf(stderr, "warning: could not remove old checkpoints: %s\n", e.what());
    }
  }
  comm_->barrier();  // nobody saves again while rank 0 still prunes
  last_checkpoint_ = dir;
  last_checkpoint_step_ = state_.step;
  return dir;
}

std::string Trainer::resume(const std::string& spec) {
  if (spec != "auto") {
    restore_train_state(spec, load_checkpoint(spec));
    return spec;
  }
  // Rank 0 lists the complete checkpoints, newest first, so every rank tries
  // the same ones even if their views of a shared filesystem differ a moment.
  std::vector<int64_t> steps;
  if (comm_->rank() == 0) {
    for (const auto& e : ck::list_complete(config_.run.dir)) steps.push_back(e.step);
  }
  auto count = torch::tensor({static_cast<int64_t>(steps.size())}, torch::kLong);
  comm_->broadcast(count);
  steps.resize(static_cast<size_t>(count.item<int64_t>()));
  if (steps.empty()) return "";  // nothing to resume from: a fresh start
  auto all = torch::tensor(steps, torch::kLong);
  comm_->broadcast(all);
  for (int64_t i = 0; i < all.numel(); ++i) {
    const std::string dir = ck::checkpoint_dir(config_.run.dir, all[i].item<int64_t>());
    try {
      restore_train_state(dir, load_checkpoint(dir));
      return dir;
    } catch (const CheckpointError& e) {
      // Load errors reach every rank alike, so all ranks fall back together.
      if (i + 1 == all.numel()) throw;
      if (comm_->rank() == 0) {
        std::fprintf(stderr, "warning: cannot resume from %s: %s; falling back to the previous "
                     "complete checkpoint\n", dir.c_str(), e.what());
        std::fflush(stderr);
      }
    }
  }
  return "";
}

ck::LoadResult Trainer::load_checkpoint(const std::string& dir) {
  std::vector<strategy::ShardedTensor> targets = strategy_->sharded_state_dict();
  if (!frozen_names_.empty()) {  // a checkpoint may reference its frozen base
    ck::CheckpointReader reader(dir);
    detail::drop_referenced_base(reader, {frozen_names_, base_identity_, reference_base_}, targets);
  }
  ck::LoadResult loaded = ck::load_sharded(dir, *comm_, targets);
  strategy_->reload_parameters();
  ck::load_optimizer_state(dir, *comm_, *optimizer_, strategy_->optimizer_parameters());
  return loaded;
}

void Trainer::restore_train_state(const std::string& dir, const ck::LoadResult& loaded) {
  nlohmann::json state;
  try {
    state = ::shardtrain::detail::parse_json_text(loaded.train_state);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(::shardtrain::detail::str_cat(
        "cannot resume from '", dir, "': its training state (train_state.bin) is not the trainer's: ",
        e.what(), ". Hint: this checkpoint was not written by the Trainer; load it with "
        "checkpoint::load_sharded instead"));
  }
  ST_CHECK(state.is_object() && state.value("format", 0) == kTrainStateFormat, CheckpointError,
           "cannot resume from '", dir, "': training-state format ",
           state.is_object() ? state.value("format", 0) : 0, ", this build reads ", kTrainStateFormat);
  try {
    state_.step = state.at("step").get<int64_t>();
    state_.epoch = state.at("epoch").get<int64_t>();
    if (auto* scaler = precision_->scaler(); scaler && state.contains("loss_scaler")) {
      const auto& j = state["loss_scaler"];
      precision::LossScalerState s;
      s.scale = j.at("scale").get<double>();
      s.iteration = j.at("iteration").get<int64_t>();
      s.last_overflow_iteration = j.at("last_overflow_iteration").get<int64_t>();
      s.hysteresis_left = j.at("hysteresis_left").get<int>();
      s.skips_at_min = j.at("skips_at_min").get<int64_t>();
      s.skipped_steps = j.at("skipped_steps").get<int64_t>();
      scaler->load_state(s);
    }
    if (state.contains("best") && state["best"].value("monitor", "") == config_.checkpoint.monitor) {
      best_value_ = state["best"].at("value").get<double>();
      best_step_ = state["best"].at("step").get<int64_t>();
    }
    if (config_.distributed.load_balance() == LoadBalance::Measured && state.contains("load_balance") &&
        !balance_->restore(state["load_balance"].dump()) && comm_->rank() == 0) {
      std::fprintf(stderr, "warning: the checkpoint's load-balance shares are for %zu data-parallel ranks, this "
                   "run has %d; starting from shares by threads and measuring again\n",
                   state["load_balance"].at("shares").size(), balance_->ranks());
    }
  } catch (const nlohmann::json::exception& e) {
    // A missing or mistyped field: the checkpoint's fault, not a bug of ours.
    throw CheckpointError(::shardtrain::detail::str_cat(
        "cannot resume from '", dir, "': its training state (train_state.bin) is damaged: ",
        e.what(), ". Hint: load an older checkpoint"));
  }
  // The same rank layout continues its own random streams; another one
  // starts them from the seed (the data order does not depend on them).
  if (loaded.rank_state_restored && !loaded.rank_state.empty()) set_rng_state(loaded.rank_state);
}

void Trainer::note_evaluation() {
  const std::string& monitor = config_.checkpoint.monitor;
  if (monitor.empty()) return;
  const std::optional<double> v = state_.eval_metrics.number(monitor);
  if (!v) return;
  const bool better =
      best_step_ < 0 || (config_.checkpoint.mode == MonitorMode::Min ? *v < best_value_ : *v > best_value_);
  if (!better) return;
  best_value_ = *v;
  best_step_ = state_.step;
  control_.should_save = true;  // the best is this step's state: keep it on disk
}

}  // namespace shardtrain::train
