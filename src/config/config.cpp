// Config loading: YAML text -> overrides -> key check -> typed read -> checks.
//
// The set of known keys is not listed twice: it is the YAML that to_yaml()
// writes for a default Config, so a key added to the structs, to read() and to
// to_yaml() is known everywhere at once. Every message names the full key
// path, the value, what is allowed and where the value came from (file:line,
// or the --set override that wrote it).
#include "shardtrain/config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <map>
#include <sstream>
#include <type_traits>
#include <utility>

#include "shardtrain/core/error.h"

namespace shardtrain::config {
namespace {

using detail::str_cat;

constexpr const char* kDocsHint = "see docs/config.md";
constexpr const char* kOverrideSyntax =
    "expected KEY=VALUE with a dotted key and a YAML value, e.g. --set optimizer.lr=1e-3, "
    "--set optimizer.betas=[0.9,0.99] or --set batch.accumulate=null";

// ---- formatting ------------------------------------------------------------------

// The shortest decimal text that reads back to exactly `v`, with a ".0" on
// whole numbers so the YAML reads as a float.
std::string format_double(double v) {
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  // %g writes 100 as 1e+02; plain decimals read better from 1e-4 to 1e15.
  if (v != 0.0 && std::isfinite(v)) {
    const int exponent = static_cast<int>(std::floor(std::log10(std::fabs(v))));
    if (exponent >= -4 && exponent < 15) {
      char fixed[64];
      std::snprintf(fixed, sizeof(fixed), "%.*f", std::max(0, precision - 1 - exponent), v);
      if (std::strtod(fixed, nullptr) == v) std::snprintf(buf, sizeof(buf), "%s", fixed);
    }
  }
  std::string s = buf;
  if (s.find_first_not_of("-0123456789") == std::string::npos) s += ".0";
  return s;
}

bool is_yaml_reserved(const std::string& s) {
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* word : {"null", "~", "true", "false", "yes", "no", "on", "off", "y", "n"}) {
    if (lower == word) return true;
  }
  return false;
}

// A string as a YAML scalar: plain when it is a simple word or path that YAML
// reads back as the same string, double-quoted otherwise.
std::string format_string(const std::string& s) {
  const bool simple =
      !s.empty() && !is_yaml_reserved(s) &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-") ==
          std::string::npos &&
      s.front() != '-' && s.front() != '.';
  if (simple) return s;
  YAML::Emitter out;
  out << YAML::DoubleQuoted << s;
  return out.c_str();
}

// A node as it appears in a message: scalars quoted as written, the rest in
// flow style.
std::string show(const YAML::Node& node) {
  if (node.IsNull()) return "null";
  if (node.IsScalar()) return "'" + node.Scalar() + "'";
  YAML::Emitter out;
  out << YAML::Flow << node;
  return out.c_str();
}

std::string join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) out += (i ? sep : "") + items[i];
  return out;
}

std::string one_of(const std::vector<std::string>& allowed) {
  return "one of: " + join(allowed, ", ");
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::vector<std::string> split_dots(const std::string& key) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    parts.push_back(key.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) return parts;
    start = dot + 1;
  }
}

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  const size_t end = s.find_last_not_of(" \t");
  return s.substr(begin, end - begin + 1);
}

std::string key_path(const std::string& prefix, const std::string& key) {
  return prefix.empty() ? key : prefix + "." + key;
}

// The default Config as a YAML tree: every known key, sections as maps.
const YAML::Node& schema() {
  static const YAML::Node tree = YAML::Load(Config().to_yaml());
  return tree;
}

std::vector<std::string> keys_of(const YAML::Node& map) {
  std::vector<std::string> keys;
  for (const auto& item : map) keys.push_back(item.first.Scalar());
  return keys;
}

// "did you mean ...?" for an unknown key: the closest sibling within edit
// distance 2, else the same key name in another section.
std::string suggestion(const std::string& key, const YAML::Node& siblings) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& known : keys_of(siblings)) {
    const size_t d = edit_distance(key, known);
    if (d < best_distance) {
      best = known;
      best_distance = d;
    }
  }
  if (!best.empty()) return "did you mean '" + best + "'? ";
  std::vector<std::string> elsewhere;
  for (const auto& item : schema()) {
    const YAML::Node section = item.second;
    if (section.IsMap() && section[key].IsDefined()) {
      elsewhere.push_back(item.first.Scalar() + "." + key);
    }
  }
  if (!elsewhere.empty()) return "did you mean '" + join(elsewhere, "' or '") + "'? ";
  return "";
}

// `parent[key]` when both exist, else a null node (yaml-cpp's lookup of a
// missing key gives an invalid node that throws when asked its type).
YAML::Node section(const YAML::Node& parent, const char* key) {
  if (!parent.IsMap()) return YAML::Node();
  const YAML::Node child = parent[key];
  return child.IsDefined() ? child : YAML::Node();
}

bool checked_mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

// ---- the loader ---------------------------------------------------------------------

class Loader {
 public:
  explicit Loader(std::string origin) : origin_(std::move(origin)) {}

  YAML::Node load_text(const std::string& text) const {
    YAML::Node root;
    try {
      root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      const std::string at = e.mark.is_null()
                                 ? origin_
                                 : str_cat(origin_, ":", e.mark.line + 1, ":", e.mark.column + 1);
      throw ConfigError(str_cat(at, ": invalid YAML: ", e.msg,
                                "; fix the syntax there (indentation, a ':' after each key, "
                                "closed brackets and quotes)"));
    }
    if (root.IsNull()) return YAML::Node(YAML::NodeType::Map);
    if (!root.IsMap()) {
      fail_at(where("", &root), "<top level>", show(root),
              "a mapping of sections (run:, model:, data:, ...)");
    }
    return root;
  }

  // Applies one "a.b=c" override onto the tree.
  void apply_override(YAML::Node& root, const std::string& text) {
    const size_t eq = text.find('=');
    const std::string key = eq == std::string::npos ? "" : trim(text.substr(0, eq));
    const std::vector<std::string> parts = split_dots(key);
    const bool empty_part =
        std::any_of(parts.begin(), parts.end(), [](const std::string& p) { return p.empty(); });
    if (eq == std::string::npos || key.empty() || empty_part) {
      throw ConfigError(str_cat("--set '", text, "': malformed override; ", kOverrideSyntax));
    }
    YAML::Node value;
    try {
      value = YAML::Load(text.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      throw ConfigError(str_cat("--set '", text, "': ", key, ": the value is not valid YAML (",
                                e.msg, "); ", kOverrideSyntax));
    }
    // The key must name a known key or section, part by part.
    const YAML::Node* known = &schema();
    std::vector<YAML::Node> levels;  // keeps each looked-up schema level alive
    levels.reserve(parts.size());
    std::string path;
    for (const std::string& part : parts) {
      if (!known->IsMap()) {
        throw ConfigError(str_cat("--set '", text, "': ", path, " is a value, not a section, so ",
                                  key, " is not a key; ", kDocsHint));
      }
      levels.push_back((*known)[part]);
      if (!levels.back().IsDefined()) {
        throw ConfigError(str_cat("--set '", text, "': ", key_path(path, part),
                                  ": unknown key; ", suggestion(part, *known), "keys in ",
                                  path.empty() ? "the top level" : path, ": ",
                                  join(keys_of(*known), ", "), "; ", kDocsHint));
      }
      known = &levels.back();
      path = key_path(path, part);
    }
    set_path(root, parts, 0, value, text);
    overrides_.emplace_back(key, text);
  }

  // Every key in `node` must be in `known`; sections recurse.
  void check_keys(const YAML::Node& node, const YAML::Node& known, const std::string& prefix) {
    for (const auto& item : node) {
      const std::string key = item.first.Scalar();
      const std::string path = key_path(prefix, key);
      const YAML::Node expected = known[key];
      if (!expected.IsDefined()) {
        fail_at(where(path, &item.first), path, "",
                "", str_cat("unknown key; ", suggestion(key, known), "keys in ",
                            prefix.empty() ? "the top level" : prefix, ": ",
                            join(keys_of(known), ", ")));
      }
      if (expected.IsMap()) {
        if (item.second.IsMap()) {
          check_keys(item.second, expected, path);
        } else if (!item.second.IsNull()) {
          fail_at(where(path, &item.second), path, show(item.second),
                  str_cat("a section with keys ", join(keys_of(expected), ", ")));
        }
      }
    }
  }

  Config read(const YAML::Node& root) {
    Config c;
    const YAML::Node run = section(root, "run");
    get(run, "run.dir", c.run.dir);
    get(run, "run.seed", c.run.seed);

    const YAML::Node model = section(root, "model");
    get(model, "model.type", c.model.type);
    get(model, "model.n_layer", c.model.n_layer);
    get(model, "model.n_head", c.model.n_head);
    get(model, "model.n_embd", c.model.n_embd);
    get(model, "model.block_size", c.model.block_size);
    get(model, "model.vocab_size", c.model.vocab_size);
    get(model, "model.activation_checkpointing", c.model.activation_checkpointing);
    get(model, "model.mlp_sizes", c.model.mlp_sizes);
    get(model, "model.init_from", c.model.init_from);

    const YAML::Node data = section(root, "data");
    get(data, "data.train", c.data.train);
    get(data, "data.val_fraction", c.data.val_fraction);
    get(data, "data.shuffle", c.data.shuffle);

    const YAML::Node batch = section(root, "batch");
    get(batch, "batch.global", c.batch.global);
    get(batch, "batch.micro", c.batch.micro);
    get(batch, "batch.accumulate", c.batch.accumulate);

    const YAML::Node optimizer = section(root, "optimizer");
    get(optimizer, "optimizer.name", c.optimizer.name);
    get(optimizer, "optimizer.lr", c.optimizer.lr);
    get(optimizer, "optimizer.weight_decay", c.optimizer.weight_decay);
    get(optimizer, "optimizer.betas", c.optimizer.betas);
    get(optimizer, "optimizer.eps", c.optimizer.eps);
    get(optimizer, "optimizer.momentum", c.optimizer.momentum);

    const YAML::Node schedule = section(root, "schedule");
    get(schedule, "schedule.name", c.schedule.name);
    get(schedule, "schedule.warmup_steps", c.schedule.warmup_steps);
    get(schedule, "schedule.min_lr", c.schedule.min_lr);

    const YAML::Node trainer = section(root, "trainer");
    TrainerConfig& t = c.trainer;
    get(trainer, "trainer.max_steps", t.max_steps);
    get(trainer, "trainer.eval_every", t.eval_every);
    get(trainer, "trainer.eval_batches", t.eval_batches);
    get(trainer, "trainer.log_every", t.log_every);
    get(trainer, "trainer.max_grad_norm", t.max_grad_norm);
    get(trainer, "trainer.progress", t.progress);
    get(trainer, "trainer.sample_tokens", t.sample_tokens);
    const YAML::Node early = section(trainer, "early_stopping");
    get(early, "trainer.early_stopping.enabled", t.early_stopping.enabled);
    get(early, "trainer.early_stopping.monitor", t.early_stopping.monitor);
    get(early, "trainer.early_stopping.patience", t.early_stopping.patience);
    get(early, "trainer.early_stopping.min_delta", t.early_stopping.min_delta);
    get(early, "trainer.early_stopping.mode", t.early_stopping.mode);

    const YAML::Node dist = section(root, "distributed");
    get(dist, "distributed.strategy", c.distributed.strategy);
    get_nproc(dist, "distributed.nproc_per_node", c.distributed.nproc_per_node);
    get(dist, "distributed.bucket_cap_mb", c.distributed.bucket_cap_mb);
    get(dist, "distributed.first_bucket_mb", c.distributed.first_bucket_mb);
    get(dist, "distributed.find_unused_parameters", c.distributed.find_unused_parameters);
    get(dist, "distributed.threads_per_rank", c.distributed.threads_per_rank);
    get(dist, "distributed.reduce_dtype", c.distributed.reduce_dtype);
    DistributedConfig& d = c.distributed;
    get(dist, "distributed.param_dtype", d.param_dtype);
    get(dist, "distributed.sharding", d.sharding);
    get(dist, "distributed.auto_wrap_policy", d.auto_wrap_policy);
    get(dist, "distributed.wrap_module_types", d.wrap_module_types);
    get(dist, "distributed.min_num_params", d.min_num_params);
    get(dist, "distributed.backward_prefetch", d.backward_prefetch);
    get(dist, "distributed.forward_prefetch", d.forward_prefetch);
    get(dist, "distributed.limit_all_gathers", d.limit_all_gathers);
    get(dist, "distributed.accumulation", d.accumulation);
    get(dist, "distributed.memory_budget_mb", d.memory_budget_mb);

    const YAML::Node scaler = section(root, "loss_scaler");
    LossScalerConfig& ls = c.loss_scaler;
    get(scaler, "loss_scaler.initial_scale_power", ls.initial_scale_power);
    get(scaler, "loss_scaler.loss_scale_window", ls.loss_scale_window);
    get(scaler, "loss_scaler.hysteresis", ls.hysteresis);
    get(scaler, "loss_scaler.min_loss_scale", ls.min_loss_scale);
    get(scaler, "loss_scaler.max_skips_at_min", ls.max_skips_at_min);

    const YAML::Node ckpt = section(root, "checkpoint");
    CheckpointConfig& k = c.checkpoint;
    get(ckpt, "checkpoint.every_n_steps", k.every_n_steps);
    get(ckpt, "checkpoint.every_n_minutes", k.every_n_minutes);
    get(ckpt, "checkpoint.keep", k.keep);
    get(ckpt, "checkpoint.monitor", k.monitor);
    get(ckpt, "checkpoint.mode", k.mode);
    get(ckpt, "checkpoint.resume", k.resume);
    get(ckpt, "checkpoint.save_on_signal", k.save_on_signal);

    if (root["precision"].IsDefined()) {
      const YAML::Node node = root["precision"];
      remember("precision", node);
      c.precision = as_string("precision", node);
    }
    return c;
  }

  // Values that are each well-typed but out of range or contradict each other.
  void validate(const Config& c) const {
    const auto positive = [&](const std::string& path, int64_t v) {
      require(v >= 1, path, std::to_string(v), "an integer >= 1");
    };
    const auto non_negative = [&](const std::string& path, int64_t v) {
      require(v >= 0, path, std::to_string(v), "an integer >= 0");
    };
    const auto choice = [&](const std::string& path, const std::string& v,
                            const std::vector<std::string>& allowed) {
      require(std::find(allowed.begin(), allowed.end(), v) != allowed.end(), path,
              "'" + v + "'", one_of(allowed));
    };

    require(!c.run.dir.empty(), "run.dir", "''", "a directory path");

    const ModelConfig& m = c.model;
    choice("model.type", m.type, {"gpt", "mlp"});
    positive("model.n_layer", m.n_layer);
    positive("model.n_head", m.n_head);
    positive("model.n_embd", m.n_embd);
    positive("model.block_size", m.block_size);
    positive("model.vocab_size", m.vocab_size);
    require(m.n_embd % m.n_head == 0, "model.n_embd", std::to_string(m.n_embd),
            str_cat("a multiple of model.n_head=", m.n_head,
                    " (each head gets n_embd / n_head channels)"),
            {"model.n_head"});
    require(m.mlp_sizes.size() >= 2, "model.mlp_sizes", format_list(m.mlp_sizes),
            "a list of at least two layer widths [in, hidden..., out]");
    for (size_t i = 0; i < m.mlp_sizes.size(); ++i) {
      require(m.mlp_sizes[i] >= 1, "model.mlp_sizes", format_list(m.mlp_sizes),
              "widths that are integers >= 1");
    }

    require(!c.data.train.empty(), "data.train", "''", "a path to a text or token file");
    require(c.data.val_fraction >= 0.0 && c.data.val_fraction < 1.0, "data.val_fraction",
            format_double(c.data.val_fraction), "a number in [0, 1); 0 disables evaluation data");

    const BatchConfig& b = c.batch;
    if (b.global) positive("batch.global", *b.global);
    if (b.micro) positive("batch.micro", *b.micro);
    if (b.accumulate) positive("batch.accumulate", *b.accumulate);
    const int given = (b.global ? 1 : 0) + (b.micro ? 1 : 0) + (b.accumulate ? 1 : 0);
    require(given >= 2, "batch", batch_text(b),
            "at least two of batch.global, batch.micro, batch.accumulate "
            "(global = micro × accumulate × world_size derives the third)");
    // What no world size can fix is an error now; the rest waits for resolve_batch().
    if (b.global && b.micro && b.accumulate) {
      int64_t unit = 0;
      const bool fits = checked_mul(*b.micro, *b.accumulate, unit);
      require(fits && *b.global % unit == 0, "batch.global", std::to_string(*b.global),
              str_cat("a multiple of batch.micro × batch.accumulate = ", *b.micro, " × ",
                      *b.accumulate, " = ", unit,
                      " for any world size; or set one of the three to null to derive it"),
              {"batch.micro", "batch.accumulate"});
    } else if (b.global && (b.micro || b.accumulate)) {
      const char* name = b.micro ? "batch.micro" : "batch.accumulate";
      const int64_t other = b.micro ? *b.micro : *b.accumulate;
      require(*b.global % other == 0, "batch.global", std::to_string(*b.global),
              str_cat("a multiple of ", name, "=", other), {name});
    }

    const OptimizerConfig& o = c.optimizer;
    choice("optimizer.name", o.name, {"adamw", "sgd"});
    require(o.lr > 0.0, "optimizer.lr", format_double(o.lr), "a number > 0, e.g. 3e-4");
    require(o.weight_decay >= 0.0, "optimizer.weight_decay", format_double(o.weight_decay),
            "a number >= 0");
    const bool betas_ok = o.betas.size() == 2 &&
                          std::all_of(o.betas.begin(), o.betas.end(),
                                      [](double beta) { return beta >= 0.0 && beta < 1.0; });
    require(betas_ok, "optimizer.betas", format_list(o.betas),
            "a list of two numbers in [0, 1), e.g. [0.9, 0.95]");
    require(o.eps > 0.0, "optimizer.eps", format_double(o.eps), "a number > 0, e.g. 1e-8");
    require(o.momentum >= 0.0 && o.momentum < 1.0, "optimizer.momentum",
            format_double(o.momentum), "a number in [0, 1)");

    const ScheduleConfig& s = c.schedule;
    choice("schedule.name", s.name, {"constant", "linear", "cosine"});
    non_negative("schedule.warmup_steps", s.warmup_steps);
    require(s.min_lr >= 0.0, "schedule.min_lr", format_double(s.min_lr), "a number >= 0");
    if (s.name != "constant") {
      require(s.min_lr <= o.lr, "schedule.min_lr", format_double(s.min_lr),
              str_cat("a number <= optimizer.lr=", format_double(o.lr),
                      " (the ", s.name, " schedule decays from lr down to min_lr)"),
              {"optimizer.lr", "schedule.name"});
    }

    const TrainerConfig& t = c.trainer;
    positive("trainer.max_steps", t.max_steps);
    non_negative("trainer.eval_every", t.eval_every);
    positive("trainer.eval_batches", t.eval_batches);
    positive("trainer.log_every", t.log_every);
    require(t.max_grad_norm >= 0.0, "trainer.max_grad_norm", format_double(t.max_grad_norm),
            "a number >= 0; 0 disables clipping");
    choice("trainer.progress", t.progress, {"auto", "bar", "plain", "none"});
    non_negative("trainer.sample_tokens", t.sample_tokens);
    const CheckpointConfig& k = c.checkpoint;
    non_negative("checkpoint.every_n_steps", k.every_n_steps);
    require(k.every_n_minutes >= 0.0, "checkpoint.every_n_minutes", format_double(k.every_n_minutes),
            "a number of minutes >= 0; 0 turns time-based saving off");
    non_negative("checkpoint.keep", k.keep);
    choice("checkpoint.mode", k.mode, {"min", "max"});

    const EarlyStoppingConfig& e = t.early_stopping;
    require(!e.monitor.empty(), "trainer.early_stopping.monitor", "''",
            "a metric name from the evaluation lines, e.g. eval_loss");
    positive("trainer.early_stopping.patience", e.patience);
    require(e.min_delta >= 0.0, "trainer.early_stopping.min_delta", format_double(e.min_delta),
            "a number >= 0");
    choice("trainer.early_stopping.mode", e.mode, {"min", "max"});
    if (e.enabled) {
      require(t.eval_every > 0, "trainer.early_stopping.enabled", "true",
              "false while trainer.eval_every=0: early stopping needs evaluations; set "
              "trainer.eval_every > 0",
              {"trainer.eval_every"});
      require(c.data.val_fraction > 0.0, "trainer.early_stopping.enabled", "true",
              "false while data.val_fraction=0: early stopping needs held-out data",
              {"data.val_fraction"});
    }

    const DistributedConfig& d = c.distributed;
    choice("distributed.strategy", d.strategy, {"single", "ddp", "zero1", "fsdp", "auto"});
    require(d.nproc_per_node >= 0, "distributed.nproc_per_node",
            std::to_string(d.nproc_per_node), "auto or an integer >= 1");
    require(d.strategy != "single" || d.nproc_per_node <= 1, "distributed.nproc_per_node",
            std::to_string(d.nproc_per_node),
            "auto or 1 with distributed.strategy=single (it runs one process); use "
            "strategy ddp, zero1, fsdp or auto for more ranks",
            {"distributed.strategy"});
    require(d.bucket_cap_mb > 0.0, "distributed.bucket_cap_mb", format_double(d.bucket_cap_mb),
            "a number of MiB > 0");
    require(d.first_bucket_mb > 0.0, "distributed.first_bucket_mb",
            format_double(d.first_bucket_mb), "a number of MiB > 0");
    non_negative("distributed.threads_per_rank", d.threads_per_rank);

    choice("distributed.reduce_dtype", d.reduce_dtype, {"fp32", "bf16", "fp16"});
    choice("distributed.param_dtype", d.param_dtype, {"auto", "fp32", "bf16", "fp16"});
    require(d.param_dtype == "auto" || (d.strategy != "single" && d.strategy != "ddp"),
            "distributed.param_dtype", d.param_dtype,
            "auto with strategy " + d.strategy +
                ": a separate gathered copy needs zero1 or fsdp (fsdp with sharding no_shard is "
                "ddp through that path); or use precision bf16-mixed",
            {"distributed.strategy"});
    // The fsdp keys are checked whatever the strategy, so a file stays valid
    // when the strategy is switched.
    choice("distributed.sharding", d.sharding,
           {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"});
    choice("distributed.auto_wrap_policy", d.auto_wrap_policy, {"module_type", "size", "none"});
    for (const std::string& type : d.wrap_module_types) {
      require(!type.empty(), "distributed.wrap_module_types", format_list(d.wrap_module_types),
              "non-empty module type names (or their suffixes), e.g. [BlockImpl]");
    }
    require(d.auto_wrap_policy != "module_type" || !d.wrap_module_types.empty(),
            "distributed.wrap_module_types", "[]",
            "at least one module type name with distributed.auto_wrap_policy=module_type, "
            "e.g. [BlockImpl]; for a single unit use auto_wrap_policy none",
            {"distributed.auto_wrap_policy"});
    positive("distributed.min_num_params", d.min_num_params);
    choice("distributed.backward_prefetch", d.backward_prefetch,
           {"backward_pre", "backward_post", "none"});
    positive("distributed.limit_all_gathers", d.limit_all_gathers);
    choice("distributed.accumulation", d.accumulation, {"sharded", "unsharded"});
    require(d.memory_budget_mb >= 0.0, "distributed.memory_budget_mb",
            format_double(d.memory_budget_mb),
            "a number of MiB >= 0; 0: MemAvailable divided by the local ranks");
    // fp16-mixed is a known name; whether this machine can run it (CUDA) is
    // decided when the precision plugin is created.
    choice("precision", c.precision, {"fp32", "bf16-mixed", "fp16-mixed", "bf16-true"});
    const LossScalerConfig& ls = c.loss_scaler;
    require(ls.initial_scale_power >= 0 && ls.initial_scale_power <= 64,
            "loss_scaler.initial_scale_power", std::to_string(ls.initial_scale_power),
            "an integer in 0..64 (the first scale is 2^power)");
    require(ls.loss_scale_window >= 1, "loss_scaler.loss_scale_window",
            std::to_string(ls.loss_scale_window), "an integer >= 1");
    require(ls.hysteresis >= 1, "loss_scaler.hysteresis", std::to_string(ls.hysteresis),
            "an integer >= 1");
    require(ls.min_loss_scale > 0.0, "loss_scaler.min_loss_scale",
            format_double(ls.min_loss_scale), "a number > 0");
    non_negative("loss_scaler.max_skips_at_min", ls.max_skips_at_min);
  }

  static std::string batch_text(const BatchConfig& b) {
    const auto one = [](const std::optional<int64_t>& v) {
      return v ? std::to_string(*v) : std::string("null");
    };
    return str_cat("{global: ", one(b.global), ", micro: ", one(b.micro),
                   ", accumulate: ", one(b.accumulate), "}");
  }

 private:
  // ---- where a value came from ----

  std::string where(const std::string& path, const YAML::Node* node) const {
    for (auto it = overrides_.rbegin(); it != overrides_.rend(); ++it) {
      const std::string& key = it->first;
      if (path == key || path.rfind(key + ".", 0) == 0) {
        return str_cat("--set '", it->second, "' (on ", origin_, ")");
      }
    }
    if (node != nullptr && !node->Mark().is_null()) {
      return str_cat(origin_, ":", node->Mark().line + 1);
    }
    return origin_;
  }

  // Where the first of `paths` that the input set came from (a section
  // matches any key under it); the origin alone when all are defaults.
  std::string where_seen(const std::vector<std::string>& paths) const {
    for (const std::string& path : paths) {
      const auto it = seen_.find(path);
      if (it != seen_.end()) return it->second;
      for (const auto& [key, at] : seen_) {
        if (key.rfind(path + ".", 0) == 0) return at;
      }
    }
    return str_cat(origin_, " (", paths.front(), " at its default)");
  }

  void remember(const std::string& path, const YAML::Node& node) {
    seen_[path] = where(path, &node);
  }

  [[noreturn]] void fail_at(const std::string& at, const std::string& path, const std::string& got,
                            const std::string& expected, const std::string& problem = "") const {
    if (!problem.empty()) throw ConfigError(str_cat(at, ": ", path, ": ", problem, "; ", kDocsHint));
    throw ConfigError(
        str_cat(at, ": ", path, ": got ", got, ", expected ", expected, "; ", kDocsHint));
  }

  // `also`: other keys of a cross-key check, tried for the origin when
  // `path` itself was left at its default.
  void require(bool ok, const std::string& path, const std::string& got,
               const std::string& expected, std::vector<std::string> also = {}) const {
    if (ok) return;
    also.insert(also.begin(), path);
    fail_at(where_seen(also), path, got, expected);
  }

  [[noreturn]] void type_error(const std::string& path, const YAML::Node& node,
                               const std::string& expected) const {
    fail_at(where(path, &node), path, show(node), expected);
  }

  // ---- typed reads ----

  void set_path(YAML::Node node, const std::vector<std::string>& parts, size_t i,
                const YAML::Node& value, const std::string& text) {
    if (i + 1 == parts.size()) {
      node[parts[i]] = value;
      return;
    }
    const YAML::Node child = node[parts[i]];
    if (!child.IsDefined() || child.IsNull()) {
      node[parts[i]] = YAML::Node(YAML::NodeType::Map);
    } else if (!child.IsMap()) {
      const std::vector<std::string> head(parts.begin(), parts.begin() + static_cast<long>(i) + 1);
      const std::string path = join(head, ".");
      fail_at(where(path, &child), path, show(child),
              str_cat("a section (a mapping) so that --set '", text, "' can apply"));
    }
    set_path(node[parts[i]], parts, i + 1, value, text);
  }

  // Reads `section[last part of path]` into `out` when present; absent keys
  // keep the struct default.
  template <typename T>
  void get(const YAML::Node& section, const std::string& path, T& out) {
    if (!section.IsMap()) return;
    const std::string key = path.substr(path.rfind('.') + 1);
    const YAML::Node node = section[key];
    if (!node.IsDefined()) return;
    remember(path, node);
    read_value(path, node, out);
  }

  void get_nproc(const YAML::Node& section, const std::string& path, int64_t& out) {
    if (!section.IsMap()) return;
    const YAML::Node node = section["nproc_per_node"];
    if (!node.IsDefined()) return;
    remember(path, node);
    if (node.IsScalar() && node.Scalar() == "auto") {
      out = 0;
      return;
    }
    if (!node.IsScalar() || !parse_int(node.Scalar(), out)) {
      type_error(path, node, "auto or an integer >= 1");
    }
  }

  static bool parse_int(const std::string& text, int64_t& out) {
    if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
    errno = 0;
    char* end = nullptr;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (errno != 0 || *end != '\0') return false;
    out = v;
    return true;
  }

  static bool parse_double(const std::string& text, double& out) {
    if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    if (errno != 0 || *end != '\0' || !std::isfinite(v)) return false;
    out = v;
    return true;
  }

  std::string as_string(const std::string& path, const YAML::Node& node) const {
    if (!node.IsScalar()) type_error(path, node, "a string");
    return node.Scalar();
  }

  void read_value(const std::string& path, const YAML::Node& node, std::string& out) const {
    out = as_string(path, node);
  }

  void read_value(const std::string& path, const YAML::Node& node, int64_t& out) const {
    if (!node.IsScalar() || !parse_int(node.Scalar(), out)) {
      type_error(path, node, "an integer");
    }
  }

  void read_value(const std::string& path, const YAML::Node& node, uint64_t& out) const {
    const bool ok = node.IsScalar() && !node.Scalar().empty() &&
                    std::isdigit(static_cast<unsigned char>(node.Scalar().front()));
    if (ok) {
      errno = 0;
      char* end = nullptr;
      const unsigned long long v = std::strtoull(node.Scalar().c_str(), &end, 10);
      if (errno == 0 && *end == '\0') {
        out = v;
        return;
      }
    }
    type_error(path, node, "an integer in [0, 2^64)");
  }

  void read_value(const std::string& path, const YAML::Node& node, double& out) const {
    if (!node.IsScalar() || !parse_double(node.Scalar(), out)) {
      type_error(path, node, "a finite number");
    }
  }

  void read_value(const std::string& path, const YAML::Node& node, bool& out) const {
    if (node.IsScalar()) {
      try {
        out = node.as<bool>();
        return;
      } catch (const YAML::Exception&) {
      }
    }
    type_error(path, node, "true or false");
  }

  void read_value(const std::string& path, const YAML::Node& node,
                  std::optional<int64_t>& out) const {
    if (node.IsNull()) {
      out.reset();
      return;
    }
    int64_t v = 0;
    if (!node.IsScalar() || !parse_int(node.Scalar(), v)) {
      type_error(path, node, "an integer >= 1 or null (null: derived from the other two)");
    }
    out = v;
  }

  void read_value(const std::string& path, const YAML::Node& node,
                  std::vector<double>& out) const {
    std::vector<double> values;
    bool ok = node.IsSequence();
    for (size_t i = 0; ok && i < node.size(); ++i) {
      double v = 0.0;
      ok = node[i].IsScalar() && parse_double(node[i].Scalar(), v);
      values.push_back(v);
    }
    if (!ok) type_error(path, node, "a list of numbers, e.g. [0.9, 0.95]");
    out = values;
  }

  void read_value(const std::string& path, const YAML::Node& node,
                  std::vector<std::string>& out) const {
    std::vector<std::string> values;
    bool ok = node.IsSequence();
    for (size_t i = 0; ok && i < node.size(); ++i) {
      ok = node[i].IsScalar();
      if (ok) values.push_back(node[i].Scalar());
    }
    if (!ok) type_error(path, node, "a list of strings, e.g. [BlockImpl]");
    out = values;
  }

  void read_value(const std::string& path, const YAML::Node& node,
                  std::vector<int64_t>& out) const {
    std::vector<int64_t> values;
    bool ok = node.IsSequence();
    for (size_t i = 0; ok && i < node.size(); ++i) {
      int64_t v = 0;
      ok = node[i].IsScalar() && parse_int(node[i].Scalar(), v);
      values.push_back(v);
    }
    if (!ok) type_error(path, node, "a list of integers, e.g. [64, 128, 64]");
    out = values;
  }

  template <typename T>
  static std::string format_list(const std::vector<T>& values) {
    std::vector<std::string> items;
    for (const T& v : values) {
      if constexpr (std::is_same_v<T, std::string>) {
        items.push_back(format_string(v));
      } else if constexpr (std::is_floating_point_v<T>) {
        items.push_back(format_double(v));
      } else {
        items.push_back(std::to_string(v));
      }
    }
    return "[" + join(items, ", ") + "]";
  }

  std::string origin_;
  // (dotted key, override text), in the order applied; the last one wins.
  std::vector<std::pair<std::string, std::string>> overrides_;
  // Where each key that was present came from, for the range checks.
  std::map<std::string, std::string> seen_;
};

std::string yaml_int_list(const std::vector<int64_t>& values) {
  std::vector<std::string> items;
  for (int64_t v : values) items.push_back(std::to_string(v));
  return "[" + join(items, ", ") + "]";
}

std::string yaml_double_list(const std::vector<double>& values) {
  std::vector<std::string> items;
  for (double v : values) items.push_back(format_double(v));
  return "[" + join(items, ", ") + "]";
}

std::string yaml_string_list(const std::vector<std::string>& values) {
  std::vector<std::string> items;
  for (const std::string& v : values) items.push_back(format_string(v));
  return "[" + join(items, ", ") + "]";
}

std::string yaml_optional(const std::optional<int64_t>& v) {
  return v ? std::to_string(*v) : std::string("null");
}

const char* yaml_bool(bool v) { return v ? "true" : "false"; }


}  // namespace

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) {
    throw ConfigError(str_cat("cannot read the config file '", path,
                              "': it does not exist or is not readable; pass the path of a YAML "
                              "file such as configs/default.yaml"));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return parse(text.str(), overrides, path);
}

Config Config::parse(const std::string& yaml, const std::vector<std::string>& overrides,
                     const std::string& origin) {
  Loader loader(origin);
  YAML::Node root = loader.load_text(yaml);
  for (const std::string& text : overrides) loader.apply_override(root, text);
  loader.check_keys(root, schema(), "");
  const Config config = loader.read(root);
  loader.validate(config);
  return config;
}

std::string Config::to_yaml() const {
  std::ostringstream y;
  const auto s = [](const std::string& v) { return format_string(v); };
  const auto d = [](double v) { return format_double(v); };
  y << "# shardtrain configuration: every key; docs/config.md describes them.\n";
  y << "run:\n"
    << "  dir: " << s(run.dir) << "\n"
    << "  seed: " << run.seed << "\n";
  y << "model:\n"
    << "  type: " << s(model.type) << "\n"
    << "  n_layer: " << model.n_layer << "\n"
    << "  n_head: " << model.n_head << "\n"
    << "  n_embd: " << model.n_embd << "\n"
    << "  block_size: " << model.block_size << "\n"
    << "  vocab_size: " << model.vocab_size << "\n"
    << "  activation_checkpointing: " << yaml_bool(model.activation_checkpointing) << "\n"
    << "  mlp_sizes: " << yaml_int_list(model.mlp_sizes) << "\n"
    << "  init_from: " << s(model.init_from) << "\n";
  y << "data:\n"
    << "  train: " << s(data.train) << "\n"
    << "  val_fraction: " << d(data.val_fraction) << "\n"
    << "  shuffle: " << yaml_bool(data.shuffle) << "\n";
  y << "batch:\n"
    << "  global: " << yaml_optional(batch.global) << "\n"
    << "  micro: " << yaml_optional(batch.micro) << "\n"
    << "  accumulate: " << yaml_optional(batch.accumulate) << "\n";
  y << "optimizer:\n"
    << "  name: " << s(optimizer.name) << "\n"
    << "  lr: " << d(optimizer.lr) << "\n"
    << "  weight_decay: " << d(optimizer.weight_decay) << "\n"
    << "  betas: " << yaml_double_list(optimizer.betas) << "\n"
    << "  eps: " << d(optimizer.eps) << "\n"
    << "  momentum: " << d(optimizer.momentum) << "\n";
  y << "schedule:\n"
    << "  name: " << s(schedule.name) << "\n"
    << "  warmup_steps: " << schedule.warmup_steps << "\n"
    << "  min_lr: " << d(schedule.min_lr) << "\n";
  const EarlyStoppingConfig& e = trainer.early_stopping;
  y << "trainer:\n"
    << "  max_steps: " << trainer.max_steps << "\n"
    << "  eval_every: " << trainer.eval_every << "\n"
    << "  eval_batches: " << trainer.eval_batches << "\n"
    << "  log_every: " << trainer.log_every << "\n"
    << "  max_grad_norm: " << d(trainer.max_grad_norm) << "\n"
    << "  progress: " << s(trainer.progress) << "\n"
    << "  sample_tokens: " << trainer.sample_tokens << "\n"
    << "  early_stopping:\n"
    << "    enabled: " << yaml_bool(e.enabled) << "\n"
    << "    monitor: " << s(e.monitor) << "\n"
    << "    patience: " << e.patience << "\n"
    << "    min_delta: " << d(e.min_delta) << "\n"
    << "    mode: " << s(e.mode) << "\n";
  y << "distributed:\n"
    << "  strategy: " << s(distributed.strategy) << "\n"
    << "  nproc_per_node: "
    << (distributed.nproc_per_node == 0 ? std::string("auto")
                                        : std::to_string(distributed.nproc_per_node))
    << "\n"
    << "  bucket_cap_mb: " << d(distributed.bucket_cap_mb) << "\n"
    << "  first_bucket_mb: " << d(distributed.first_bucket_mb) << "\n"
    << "  find_unused_parameters: " << yaml_bool(distributed.find_unused_parameters) << "\n"
    << "  threads_per_rank: " << distributed.threads_per_rank << "\n"
    << "  reduce_dtype: " << s(distributed.reduce_dtype) << "\n"
    << "  param_dtype: " << s(distributed.param_dtype) << "\n"
    << "  sharding: " << s(distributed.sharding) << "\n"
    << "  auto_wrap_policy: " << s(distributed.auto_wrap_policy) << "\n"
    << "  wrap_module_types: " << yaml_string_list(distributed.wrap_module_types) << "\n"
    << "  min_num_params: " << distributed.min_num_params << "\n"
    << "  backward_prefetch: " << s(distributed.backward_prefetch) << "\n"
    << "  forward_prefetch: " << yaml_bool(distributed.forward_prefetch) << "\n"
    << "  limit_all_gathers: " << distributed.limit_all_gathers << "\n"
    << "  accumulation: " << s(distributed.accumulation) << "\n"
    << "  memory_budget_mb: " << d(distributed.memory_budget_mb) << "\n";
  y << "checkpoint:\n"
    << "  every_n_steps: " << checkpoint.every_n_steps << "\n"
    << "  every_n_minutes: " << d(checkpoint.every_n_minutes) << "\n"
    << "  keep: " << checkpoint.keep << "\n"
    << "  monitor: " << s(checkpoint.monitor) << "\n"
    << "  mode: " << s(checkpoint.mode) << "\n"
    << "  resume: " << s(checkpoint.resume) << "\n"
    << "  save_on_signal: " << yaml_bool(checkpoint.save_on_signal) << "\n";
  y << "precision: " << s(precision) << "\n";
  y << "loss_scaler:\n"
    << "  initial_scale_power: " << loss_scaler.initial_scale_power << "\n"
    << "  loss_scale_window: " << loss_scaler.loss_scale_window << "\n"
    << "  hysteresis: " << loss_scaler.hysteresis << "\n"
    << "  min_loss_scale: " << d(loss_scaler.min_loss_scale) << "\n"
    << "  max_skips_at_min: " << loss_scaler.max_skips_at_min << "\n";
  return y.str();
}

BatchPlan Config::resolve_batch(int world_size) const {
  if (world_size < 1) {
    throw ConfigError(str_cat("batch: world_size ", world_size,
                              " is not a number of ranks; it must be >= 1"));
  }
  const BatchConfig& b = batch;
  const std::string given = Loader::batch_text(b);
  const auto check_positive = [&](const char* name, const std::optional<int64_t>& v) {
    if (v && *v < 1) {
      throw ConfigError(str_cat("batch.", name, ": got ", *v, ", expected an integer >= 1 or null; ",
                                kDocsHint));
    }
  };
  check_positive("global", b.global);
  check_positive("micro", b.micro);
  check_positive("accumulate", b.accumulate);
  const int64_t world = world_size;

  BatchPlan plan;
  if (b.global && b.micro && b.accumulate) {
    int64_t per_world = 0;
    int64_t product = 0;
    const bool fits = checked_mul(*b.micro, *b.accumulate, per_world) &&
                      checked_mul(per_world, world, product);
    if (!fits || product != *b.global) {
      throw ConfigError(str_cat(
          "batch: batch.micro × batch.accumulate × world_size = ", *b.micro, " × ", *b.accumulate,
          " × ", world, " = ", fits ? std::to_string(product) : std::string("(overflow)"),
          " ≠ batch.global=", *b.global,
          "; give only two of the three (set one to null) and the third is derived"));
    }
    plan = {*b.global, *b.micro, *b.accumulate};
  } else if (b.global && b.micro) {
    int64_t unit = 0;
    if (!checked_mul(*b.micro, world, unit) || *b.global % unit != 0) {
      throw ConfigError(str_cat(
          "batch: batch.global=", *b.global, " is not divisible by batch.micro=", *b.micro,
          " × world_size=", world, " = ", unit, "; make batch.global a multiple of ", unit,
          " or change batch.micro"));
    }
    plan = {*b.global, *b.micro, *b.global / unit};
  } else if (b.global && b.accumulate) {
    int64_t unit = 0;
    if (!checked_mul(*b.accumulate, world, unit) || *b.global % unit != 0) {
      throw ConfigError(str_cat(
          "batch: batch.global=", *b.global, " is not divisible by batch.accumulate=",
          *b.accumulate, " × world_size=", world, " = ", unit,
          "; make batch.global a multiple of ", unit, " or change batch.accumulate"));
    }
    plan = {*b.global, *b.global / unit, *b.accumulate};
  } else if (b.micro && b.accumulate) {
    int64_t per_world = 0;
    int64_t global = 0;
    if (!checked_mul(*b.micro, *b.accumulate, per_world) ||
        !checked_mul(per_world, world, global)) {
      throw ConfigError(str_cat("batch: batch.micro × batch.accumulate × world_size = ", *b.micro,
                                " × ", *b.accumulate, " × ", world,
                                " overflows; use smaller batch numbers"));
    }
    plan = {global, *b.micro, *b.accumulate};
  } else {
    throw ConfigError(str_cat("batch: got ", given,
                              ", expected at least two of batch.global, batch.micro and "
                              "batch.accumulate (global = micro × accumulate × world_size "
                              "derives the third); ",
                              kDocsHint));
  }
  return plan;
}

}  // namespace shardtrain::config
