// JSON from files and peers we do not trust: safetensors headers, checkpoint
// metadata and markers, config.json, adapter_config.json, tokenizer files.
//
// nlohmann::json parses iteratively, but copying, comparing and dump() recurse
// once per nesting level, so a 1,000,000-deep `[[[...]]]` that parsed fine
// crashed the process (SIGSEGV) in the message meant to refuse it. Every
// reader of such text parses it here, where the nesting depth is bounded
// before the parser runs, and shows a hostile value only through
// json_excerpt(), which is cut short.
//
// Internal to the library (src/); callers turn a failure into their own
// typed error.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace shardtrain::detail {

/// Deeper than this, no file we read is legitimate (a safetensors header is
/// 3 levels, checkpoint metadata 4, tokenizer.json under 10).
constexpr int kMaxJsonDepth = 64;

/// True when `text`'s arrays and objects nest deeper than `max_depth`
/// (brackets inside strings do not count). Linear, no recursion.
bool json_too_deep(const std::string& text, int max_depth = kMaxJsonDepth);

/// The parser's or the depth check's complaint, on one line, at most 200
/// characters.
std::string json_parse_problem(const std::string& what);

/// `Json::parse(text)`, but text nested deeper than kMaxJsonDepth is refused
/// with the parser's own exception type (parse_error, id 101), so a caller's
/// existing `catch (const Json::exception&)` handles it.
template <class Json = nlohmann::json>
Json parse_json_text(const std::string& text) {
  if (json_too_deep(text)) {
    throw typename Json::parse_error(Json::parse_error::create(
        101, 0,
        "it nests arrays or objects deeper than " + std::to_string(kMaxJsonDepth) + " levels",
        static_cast<const Json*>(nullptr)));
  }
  return Json::parse(text);
}

/// The same without exceptions: a discarded value (is_discarded()) for text
/// that is not JSON or nests too deep.
template <class Json = nlohmann::json>
Json parse_json_or_discarded(const std::string& text) {
  if (json_too_deep(text)) return Json(Json::value_t::discarded);
  return Json::parse(text, nullptr, /*allow_exceptions=*/false);
}

/// Parses `text` into `*out`; false with `*why` set ("it nests deeper than 64
/// levels", or the parser's message) when it is not JSON we can hold safely.
template <class Json>
bool parse_json(const std::string& text, Json* out, std::string* why) {
  if (json_too_deep(text)) {
    *why = "it nests arrays or objects deeper than " + std::to_string(kMaxJsonDepth) + " levels";
    return false;
  }
  try {
    *out = parse_json_text<Json>(text);
  } catch (const typename Json::exception& e) {
    *why = json_parse_problem(e.what());
    return false;
  }
  return true;
}

/// `j` as JSON text, cut to about `max_chars` characters ("..." marks the
/// cut): how an error message shows a value from an untrusted file.
template <class Json>
std::string json_excerpt(const Json& j, size_t max_chars = 60) {
  std::string s = j.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (s.size() > max_chars) s = s.substr(0, max_chars) + "...";
  return s;
}

}  // namespace shardtrain::detail
