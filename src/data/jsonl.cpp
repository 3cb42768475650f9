// JSON-lines records: parsing each line into one of the four shapes.
#include "shardtrain/data/jsonl.h"

#include <nlohmann/json.hpp>

#include "core/file.h"
#include "core/json.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data {

namespace {

using nlohmann::json;

// The string field `key` of `j`; a missing or non-string field names origin.
std::string string_field(const json& j, const char* key, const std::string& origin,
                         bool required = true) {
  const auto it = j.find(key);
  if (it == j.end()) {
    ST_CHECK(!required, ConfigError, origin, ": the record has no \"", key,
             "\" field; hint: see docs/data.md for the record shapes");
    return "";
  }
  ST_CHECK(it->is_string(), ConfigError, origin, ": field \"", key, "\" must be a string, not ",
           it->type_name());
  return it->get<std::string>();
}

Role parse_role(const std::string& name, const std::string& origin) {
  if (name == "system") return Role::System;
  if (name == "user") return Role::User;
  if (name == "assistant") return Role::Assistant;
  ST_CHECK(false, ConfigError, origin, ": role '", name,
           "' is not one the chat templates know (system, user, assistant)");
  return Role::User;
}

std::vector<Turn> parse_messages(const json& list, const std::string& origin) {
  ST_CHECK(list.is_array() && !list.empty(), ConfigError, origin,
           ": \"messages\" must be a non-empty list of {\"role\", \"content\"}");
  std::vector<Turn> turns;
  for (size_t i = 0; i < list.size(); ++i) {
    const std::string where = origin + ": messages[" + std::to_string(i) + "]";
    ST_CHECK(list[i].is_object(), ConfigError, where, " must be an object");
    turns.push_back({parse_role(string_field(list[i], "role", where), where),
                     string_field(list[i], "content", where)});
  }
  return turns;
}

}  // namespace

const char* role_name(Role role) {
  switch (role) {
    case Role::System: return "system";
    case Role::User: return "user";
    case Role::Assistant: return "assistant";
  }
  return "?";
}

// Alpaca's two prompts, as in tatsu-lab/stanford_alpaca's train.py.
std::string alpaca_prompt(const std::string& instruction, const std::string& input) {
  if (input.empty()) {
    return "Below is an instruction that describes a task. Write a response that appropriately "
           "completes the request.\n\n### Instruction:\n" +
           instruction + "\n\n### Response:\n";
  }
  return "Below is an instruction that describes a task, paired with an input that provides "
         "further context. Write a response that appropriately completes the request.\n\n"
         "### Instruction:\n" +
         instruction + "\n\n### Input:\n" + input + "\n\n### Response:\n";
}

Record parse_record(const std::string& line, const std::string& origin) {
  json j;
  try {
    j = ::shardtrain::detail::parse_json_text(line);
  } catch (const json::parse_error& e) {
    ST_CHECK(false, ConfigError, origin, ": not valid JSON (", e.what(), ")");
  }
  ST_CHECK(j.is_object(), ConfigError, origin, ": a record must be a JSON object");
  Record r;
  r.origin = origin;
  if (j.contains("messages")) {
    r.kind = Record::Kind::Chat;
    r.messages = parse_messages(j["messages"], origin);
  } else if (j.contains("instruction")) {
    r.kind = Record::Kind::PromptCompletion;
    r.prompt = alpaca_prompt(string_field(j, "instruction", origin),
                             string_field(j, "input", origin, false));
    r.completion = string_field(j, "output", origin);
  } else if (j.contains("prompt") || j.contains("completion")) {
    r.kind = Record::Kind::PromptCompletion;
    r.prompt = string_field(j, "prompt", origin);
    r.completion = string_field(j, "completion", origin);
  } else {
    ST_CHECK(j.contains("text"), ConfigError, origin,
             ": the record has none of \"text\", \"prompt\"+\"completion\", "
             "\"instruction\"+\"output\", \"messages\"; hint: see docs/data.md");
    r.text = string_field(j, "text", origin);
  }
  return r;
}

std::vector<Record> read_jsonl(const std::string& path) {
  ::shardtrain::detail::LineReader in(kMaxRecordLineBytes);
  std::string why;
  ST_CHECK(in.open(path, &why), ConfigError, "data.train '", path, "' cannot be opened: ", why,
           "; hint: point data.train at a JSON-lines file");
  std::vector<Record> records;
  std::string line;
  while (true) {
    const auto status = in.next(&line, &why);
    if (status == ::shardtrain::detail::LineReader::Status::End) break;
    ST_CHECK(status == ::shardtrain::detail::LineReader::Status::Line, ConfigError, "data.train '",
             path, "' cannot be read: ", why, "; hint: one JSON record per line");
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    records.push_back(parse_record(line, path + ":" + std::to_string(in.line_number())));
  }
  ST_CHECK(!records.empty(), ConfigError, "data.train '", path,
           "' holds no records; hint: one JSON object per line");
  return records;
}

}  // namespace shardtrain::data
