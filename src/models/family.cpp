// The registry of model families, and reading a Hugging Face directory's
// config.json into the model section.
#include "shardtrain/models/family.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/json.h"
#include "core/file.h"
#include "models/families.h"
#include "shardtrain/config/config.h"
#include "shardtrain/core/error.h"

namespace shardtrain::models {

namespace {

// The one registration list: a new family is one line here.
const std::vector<const ModelFamily*>& registry() {
  static const std::vector<const ModelFamily*> families = {&gpt_family(), &llama_family(), &mixtral_family(), &qwen3_moe_family(), &mlp_family()};
  return families;
}

std::string hf_model_type_names() {
  std::string names;
  for (const ModelFamily* f : registry()) {
    for (const auto& t : f->hf_model_types()) names += (names.empty() ? "" : ", ") + t;
  }
  return names;
}

}  // namespace

const ModelFamily& family_of(train::ModelType type) {
  for (const ModelFamily* f : registry()) {
    if (f->type() == type) return *f;
  }
  ST_CHECK(false, ConfigError, "model.type '", enum_name(type), "' is not resolved to a family (",
           family_names(), "); hint: model.type auto needs model.init_from to be a Hugging Face "
           "model directory");
  return *registry().front();
}

std::string family_names() {
  std::string names;
  for (const ModelFamily* f : registry()) names += (names.empty() ? "" : ", ") + std::string(enum_name(f->type()));
  return names;
}

// Any entry named config.json counts: one that is not a regular file (a
// FIFO, /dev/zero) is then refused by the reader, saying what it is, instead
// of the directory being taken for something else.
bool is_hf_dir(const std::string& path) {
  std::error_code ec;
  return !path.empty() && std::filesystem::is_directory(path, ec) &&
         ::shardtrain::detail::file_kind((std::filesystem::path(path) / "config.json").string()) != "absent";
}

void resolve_model_config(config::ModelConfig& m) {
  if (!is_hf_dir(m.init_from)) {
    ST_CHECK(m.type != train::ModelType::Auto, ConfigError, "model.type auto takes the family from a "
             "Hugging Face directory's config.json, but model.init_from='", m.init_from,
             "' is not a directory holding one; hint: point model.init_from at the model directory, "
             "or set model.type to one of ", family_names());
    return;
  }
  const std::string path = (std::filesystem::path(m.init_from) / "config.json").string();
  std::string text, why;
  ST_CHECK(::shardtrain::detail::read_regular_file(path, int64_t{16} << 20, &text, &why), ConfigError,
           "cannot read '", path, "': ", why);
  nlohmann::json j;
  try {
    j = ::shardtrain::detail::parse_json_text(text);
  } catch (const nlohmann::json::exception& e) {
    ST_CHECK(false, ConfigError, "'", path, "' is not valid JSON (", e.what(),
             "); hint: it should be the config.json the model was published with");
  }
  ST_CHECK(j.is_object() && j.contains("model_type") && j["model_type"].is_string(), ConfigError, "'",
           path, "' has no model_type; supported model types: ", hf_model_type_names());
  const std::string model_type = j["model_type"].get<std::string>();
  const ModelFamily* family = nullptr;
  for (const ModelFamily* f : registry()) {
    for (const auto& t : f->hf_model_types()) {
      if (t == model_type) family = f;
    }
  }
  ST_CHECK(family != nullptr, ConfigError, "'", path, "' describes a '", model_type,
           "' model, which no family reads; supported model types: ", hf_model_type_names(),
           " (families: ", family_names(), ")");
  ST_CHECK(m.type == train::ModelType::Auto || m.type == family->type(), ConfigError, "model.type is ",
           enum_name(m.type), " but '", path, "' describes a '", model_type, "' model (family ",
           enum_name(family->type()), "); hint: set model.type to auto or ", enum_name(family->type()));
  m.type = family->type();
  try {
    family->read_hf_config(j, m);
  } catch (const nlohmann::json::exception& e) {
    ST_CHECK(false, ConfigError, "'", path, "' lacks a key the ", enum_name(family->type()),
             " family needs or holds one of the wrong type: ", e.what());
  }
  family->validate(m);
}

}  // namespace shardtrain::models
