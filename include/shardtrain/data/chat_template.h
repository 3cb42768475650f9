// Chat templates: `messages` rendered as the model family's own template
// would (written by hand from each model's tokenizer_config.json text; no
// Jinja engine), as pieces marked trained (assistant replies and their
// end-of-turn token) or not (headers, system and user turns).
#pragma once

#include <string>
#include <vector>

#include "shardtrain/data/choices.h"
#include "shardtrain/data/jsonl.h"

namespace shardtrain::data {

/// A run of rendered text. Special tokens appear as their text
/// ("<|eot_id|>") and the tokenizer matches them to their single ids.
struct Piece {
  std::string text;
  bool trained = false;
};

/// Renders a conversation for training (no generation prompt at the end).
/// A role the template does not know (mistral: system) or an order it refuses
/// (llama2/mistral: user and assistant must alternate) is a ConfigError
/// naming `origin`. `kind` must not be Auto.
std::vector<Piece> render_chat(ChatTemplateKind kind, const std::vector<Turn>& messages,
                               const std::string& origin);

/// What a model answers from: `messages` rendered as render_chat() renders
/// them, then the template's opening of an assistant reply (Hugging Face's
/// add_generation_prompt). The last message must be the user's.
std::string render_generation_prompt(ChatTemplateKind kind, const std::vector<Turn>& messages);

/// The text of the token that ends an assistant reply ("<|eot_id|>").
std::string end_of_turn(ChatTemplateKind kind);

/// The built-in template a Jinja chat template is, recognised by its
/// distinctive markers; ConfigError naming the built-ins when none matches.
ChatTemplateKind recognise_chat_template(const std::string& jinja, const std::string& origin);

/// `setting`, or for Auto the template of `model_dir`/tokenizer_config.json.
/// Auto without a model directory or template is a ConfigError naming the
/// built-ins and data.chat_template.
ChatTemplateKind resolve_chat_template(ChatTemplateKind setting, const std::string& model_dir);

}  // namespace shardtrain::data
