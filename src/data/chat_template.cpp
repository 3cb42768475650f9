// The built-in chat templates, each written by hand from its model's
// tokenizer_config.json `chat_template` (docs/data.md quotes the sources),
// rendered as trained and untrained pieces for loss masking.
#include "shardtrain/data/chat_template.h"

#include <nlohmann/json.hpp>

#include <fstream>

#include "core/file.h"
#include "core/json.h"
#include "shardtrain/core/error.h"

namespace shardtrain::data {

namespace {

// Jinja's `trim` / Python's str.strip(): whitespace off both ends.
std::string strip(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::string builtin_names() { return "llama3, chatml, qwen3, mistral, llama2"; }

// Llama 3: bos, then per message
//   <|start_header_id|>ROLE<|end_header_id|>\n\n + content|trim + <|eot_id|>
void render_llama3(const std::vector<Turn>& m, std::vector<Piece>& out) {
  out.push_back({"<|begin_of_text|>", false});
  for (const Turn& t : m) {
    out.push_back({std::string("<|start_header_id|>") + role_name(t.role) + "<|end_header_id|>\n\n",
                   false});
    const bool trained = t.role == Role::Assistant;
    out.push_back({strip(t.content), trained});
    out.push_back({"<|eot_id|>", trained});
  }
}

// ChatML as Qwen writes it: <|im_start|>ROLE\ncontent<|im_end|>\n per message.
// Qwen3 also gives the assistant replies after the last user turn an empty
// thinking block when they are last: <think>\n\n</think>\n\n (its
// `loop.last` branch with no reasoning_content).
void render_chatml(const std::vector<Turn>& m, bool qwen3, std::vector<Piece>& out) {
  size_t last_user = m.size();
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].role == Role::User) last_user = i;
  }
  for (size_t i = 0; i < m.size(); ++i) {
    const Turn& t = m[i];
    out.push_back({std::string("<|im_start|>") + role_name(t.role) + "\n", false});
    const bool trained = t.role == Role::Assistant;
    std::string content = t.content;
    if (qwen3 && trained && i + 1 == m.size() && last_user < i) {
      size_t s = content.find_first_not_of('\n');
      content = "<think>\n\n</think>\n\n" + (s == std::string::npos ? "" : content.substr(s));
    }
    out.push_back({content, trained});
    out.push_back({"<|im_end|>", trained});
    out.push_back({"\n", false});
  }
}

// Both Llama 2 and Mistral insist on user/assistant/user/...
void check_alternation(const std::vector<Turn>& m, size_t first, const char* name,
                       const std::string& origin) {
  for (size_t i = first; i < m.size(); ++i) {
    const Role want = (i - first) % 2 == 0 ? Role::User : Role::Assistant;
    ST_CHECK(m[i].role == want, ConfigError, origin, ": chat template ", name,
             " needs the roles to alternate user/assistant/user/... (after an optional system "
             "message for llama2), but message ", i, " is '", role_name(m[i].role), "'");
  }
}

// Llama 2 chat: [<<SYS>>\nsys\n<</SYS>>\n\n folded into the first user turn]
//   user:      <s>[INST] content|strip [/INST]
//   assistant: ' ' + content|strip + ' ' + </s>
void render_llama2(const std::vector<Turn>& m, const std::string& origin,
                   std::vector<Piece>& out) {
  const bool has_system = m.front().role == Role::System;
  const size_t first = has_system ? 1 : 0;
  check_alternation(m, first, "llama2", origin);
  for (size_t i = first; i < m.size(); ++i) {
    std::string content = m[i].content;
    if (i == first && has_system) {
      content = "<<SYS>>\n" + m.front().content + "\n<</SYS>>\n\n" + content;
    }
    if (m[i].role == Role::User) {
      out.push_back({"<s>", false});
      out.push_back({"[INST] " + strip(content) + " [/INST]", false});
    } else {
      out.push_back({" " + strip(content) + " ", true});
      out.push_back({"</s>", true});
    }
  }
}

// Mistral Instruct: <s> then [INST] content [/INST] for user turns and
// content</s> for assistant turns; no system role.
void render_mistral(const std::vector<Turn>& m, const std::string& origin,
                    std::vector<Piece>& out) {
  for (size_t i = 0; i < m.size(); ++i) {
    ST_CHECK(m[i].role != Role::System, ConfigError, origin, ": chat template mistral knows only "
             "the roles user and assistant, not 'system' (message ", i,
             "); hint: fold the system text into the first user message or pick another "
             "data.chat_template");
  }
  check_alternation(m, 0, "mistral", origin);
  out.push_back({"<s>", false});
  for (const Turn& t : m) {
    if (t.role == Role::User) {
      out.push_back({"[INST] " + t.content + " [/INST]", false});
    } else {
      out.push_back({t.content, true});
      out.push_back({"</s>", true});
    }
  }
}

}  // namespace

std::vector<Piece> render_chat(ChatTemplateKind kind, const std::vector<Turn>& messages,
                               const std::string& origin) {
  ST_CHECK(!messages.empty(), ConfigError, origin, ": a chat record needs at least one message");
  std::vector<Piece> out;
  switch (kind) {
    case ChatTemplateKind::Llama3: render_llama3(messages, out); break;
    case ChatTemplateKind::Chatml: render_chatml(messages, false, out); break;
    case ChatTemplateKind::Qwen3: render_chatml(messages, true, out); break;
    case ChatTemplateKind::Llama2: render_llama2(messages, origin, out); break;
    case ChatTemplateKind::Mistral: render_mistral(messages, origin, out); break;
    case ChatTemplateKind::Auto:
      ST_ASSERT(false, "render_chat: resolve the chat template before rendering");
  }
  return out;
}

std::string render_generation_prompt(ChatTemplateKind kind, const std::vector<Turn>& messages) {
  ST_CHECK(!messages.empty() && messages.back().role == Role::User, ConfigError,
           "a generation prompt ends with the user's message");
  std::string out;
  for (const Piece& p : render_chat(kind, messages, "the prompt")) out += p.text;
  switch (kind) {
    case ChatTemplateKind::Llama3: return out + "<|start_header_id|>assistant<|end_header_id|>\n\n";
    case ChatTemplateKind::Chatml:
    case ChatTemplateKind::Qwen3: return out + "<|im_start|>assistant\n";
    default: return out;  // llama2 and mistral: the reply follows [/INST]
  }
}

std::string end_of_turn(ChatTemplateKind kind) {
  switch (kind) {
    case ChatTemplateKind::Llama3: return "<|eot_id|>";
    case ChatTemplateKind::Chatml:
    case ChatTemplateKind::Qwen3: return "<|im_end|>";
    default: return "</s>";
  }
}

ChatTemplateKind recognise_chat_template(const std::string& jinja, const std::string& origin) {
  const auto has = [&jinja](const char* marker) { return jinja.find(marker) != std::string::npos; };
  if (has("<|start_header_id|>") && has("<|eot_id|>")) return ChatTemplateKind::Llama3;
  if (has("<|im_start|>") && has("<think>")) return ChatTemplateKind::Qwen3;
  if (has("<|im_start|>")) return ChatTemplateKind::Chatml;
  if (has("<<SYS>>") && has("[INST]")) return ChatTemplateKind::Llama2;
  if (has("[INST]")) return ChatTemplateKind::Mistral;
  ST_CHECK(false, ConfigError, origin, ": its chat_template is none of the built-in templates (",
           builtin_names(), "); hint: set data.chat_template to the one that matches");
  return ChatTemplateKind::Auto;
}

ChatTemplateKind resolve_chat_template(ChatTemplateKind setting, const std::string& model_dir) {
  if (setting != ChatTemplateKind::Auto) return setting;
  const std::string hint = std::string("; hint: set data.chat_template to one of ") +
                           builtin_names();
  ST_CHECK(!model_dir.empty(), ConfigError,
           "data.chat_template=auto needs a model directory (model.init_from) with a "
           "tokenizer_config.json",
           hint);
  const std::string path = model_dir + "/tokenizer_config.json";
  std::string text_in, why;
  ST_CHECK(::shardtrain::detail::read_regular_file(path, int64_t{16} << 20, &text_in, &why), ConfigError,
           "data.chat_template=auto: '", path, "' cannot be read (", why, ")", hint);
  nlohmann::json j;
  try {
    j = ::shardtrain::detail::parse_json_text(text_in);
  } catch (const nlohmann::json::exception& e) {
    ST_CHECK(false, ConfigError, "'", path, "' is not valid JSON (", e.what(), ")");
  }
  const auto it = j.find("chat_template");
  ST_CHECK(it != j.end(), ConfigError, "'", path, "' has no chat_template", hint);
  std::string text;
  if (it->is_string()) {
    text = it->get<std::string>();
  } else if (it->is_array()) {  // [{"name": "default", "template": "..."}, ...]
    for (const auto& e : *it) {
      if (e.is_object() && e.value("name", "") == "default") text = e.value("template", "");
    }
  }
  ST_CHECK(!text.empty(), ConfigError, "'", path, "' has no usable chat_template", hint);
  return recognise_chat_template(text, path);
}

}  // namespace shardtrain::data
