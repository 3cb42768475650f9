// Config loading: YAML text -> overrides -> known keys -> typed read -> checks,
// and to_yaml(). Every step is a loop over the key table (schema.cpp), so a
// key declared there is read, checked, written and documented at once. Every
// message names the full key path, the value, what is allowed and where the
// value came from (file:line, or the --set override that wrote it).
#include "shardtrain/config/config.h"

#include <fstream>
#include <optional>
#include <sstream>

#include "core/file.h"
#include "key_table.h"
#include "overrides.h"
#include "shardtrain/models/family.h"

namespace shardtrain::config {
namespace {

using namespace detail;
using shardtrain::detail::str_cat;

// The node at parts[i..] under `node`, or nothing when a part is missing (a
// section written as null is an empty section).
std::optional<YAML::Node> find_node(const YAML::Node& node, const std::vector<std::string>& parts,
                                    size_t i = 0) {
  if (i == parts.size()) return node;
  if (!node.IsMap()) return std::nullopt;
  const YAML::Node child = node[parts[i]];
  if (!child.IsDefined()) return std::nullopt;
  return find_node(child, parts, i + 1);
}

// What the model's family says tensor parallelism needs, once its
// architecture is known (a Hugging Face config.json may have set it): heads
// that divide among the ranks. Refused here, in one line, rather than as a
// reshape error in the first forward.
void check_tensor_parallel(const Config& config) {
  const int64_t tp = config.distributed.tensor_parallel();
  const int64_t pp = config.distributed.pipeline_parallel();
  const models::ModelFamily& family = models::family_of(config.model.type);
  const std::string missing = family.not_supported_yet();
  ST_CHECK(missing.empty() || (tp <= 1 && pp <= 1 && config.lora.r() == 0), ConfigError, "model.type ",
           enum_name(config.model.type), " does not support ", missing, " yet (distributed.tensor_parallel=", tp,
           ", distributed.pipeline_parallel=", pp, ", lora.r=", config.lora.r(), "); set tensor_parallel and "
           "pipeline_parallel to 1 and lora.r to 0 (data parallelism: ddp, zero1 and every fsdp sharding work)");
  if (tp <= 1) return;  // none, or auto (which picks among the degrees that divide)
  for (const auto& [key, value] : family.tensor_parallel_divisors(config.model)) {
    ST_CHECK(value % tp == 0, ConfigError, "distributed.tensor_parallel=", tp, " does not divide ", key, "=",
             value, ": each rank holds ", key, " / tensor_parallel of them; choose a tensor_parallel "
             "that divides ", key);
  }
}

// Keys that are absent keep the struct default.
Config read(Source& source, const YAML::Node& root) {
  Config config;
  for (const Key& key : keys()) {
    const std::optional<YAML::Node> node = find_node(root, split_dots(key.path));
    if (!node) continue;
    source.remember(key.path, *node);
    key.read(source, *node, config);
  }
  return config;
}

// Values that are each well-typed but out of range or contradict each other.
void validate(const Source& source, const Config& config) {
  for (const Key& key : keys()) key.check(source, config);
  check_relations(source, config);
}

}  // namespace

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  // Never blocks: a FIFO or a device is refused, not waited on.
  std::string text, why;
  if (!::shardtrain::detail::read_regular_file(path, int64_t{64} << 20, &text, &why)) {
    throw ConfigError(str_cat("cannot read the config file '", path, "': ", why,
                              "; pass the path of a YAML file such as configs/default.yaml"));
  }
  return parse(text, overrides, path);
}

Config Config::parse(const std::string& yaml, const std::vector<std::string>& overrides,
                     const std::string& origin) {
  Source source(origin);
  YAML::Node root = load_yaml(source, yaml);
  for (const std::string& text : overrides) apply_override(source, root, text);
  check_known_keys(source, root);
  Config config = read(source, root);
  validate(source, config);
  // A Hugging Face directory decides what the input left unset: its family
  // and its tokenizer (model.type and data.tokenizer become auto), as
  // fine-tuning tools take them from the model they start from.
  if (models::is_hf_dir(config.model.init_from)) {
    if (!source.was_set("model.type")) config.model.type = train::ModelType::Auto;
    if (!source.was_set("data.tokenizer")) config.data.tokenizer = "auto";
  }
  // A Hugging Face directory's config.json sets the architecture, once.
  models::resolve_model_config(config.model);
  check_tensor_parallel(config);
  return config;
}

std::string Config::to_yaml() const {
  std::ostringstream y;
  y << "# shardtrain configuration: every key; docs/config.md describes them.\n";
  std::vector<std::string> open;  // the sections of the previous key
  for (const Key& key : keys()) {
    std::vector<std::string> parts = split_dots(key.path);
    const std::string name = parts.back();
    parts.pop_back();
    size_t same = 0;
    while (same < open.size() && same < parts.size() && open[same] == parts[same]) ++same;
    for (size_t i = same; i < parts.size(); ++i) {
      y << std::string(2 * i, ' ') << parts[i] << ":\n";
    }
    open = parts;
    y << std::string(2 * parts.size(), ' ') << name << ": " << key.write(*this) << "\n";
  }
  return y.str();
}

}  // namespace shardtrain::config
