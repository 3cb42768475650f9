// JSON-lines datasets: one record per line, in one of four shapes.
//
//   {"text": "..."}                                   plain text, all trained
//   {"prompt": "...", "completion": "..."}            prompt masked, completion trained
//   {"instruction": "...", "input": "...", "output": "..."}   Alpaca ("input" optional),
//                                                     rendered with the Alpaca prompt
//   {"messages": [{"role": "system|user|assistant", "content": "..."}]}   chat
//
// Blank lines are skipped. Every error is a ConfigError naming file:line.
#pragma once

#include <string>
#include <vector>

namespace shardtrain::data {

enum class Role { System, User, Assistant };
/// "system", "user", "assistant".
const char* role_name(Role role);

struct Turn {
  Role role;
  std::string content;
};

/// One example as read from a line.
struct Record {
  enum class Kind { Text, PromptCompletion, Chat };
  Kind kind = Kind::Text;
  std::string text;        // Kind::Text
  std::string prompt;      // Kind::PromptCompletion (Alpaca: the rendered prompt)
  std::string completion;  // Kind::PromptCompletion
  std::vector<Turn> messages;  // Kind::Chat
  std::string origin;      // "file:line", for messages
};

/// The Alpaca prompt for `instruction` and `input` (empty: the no-input form).
std::string alpaca_prompt(const std::string& instruction, const std::string& input);

/// Parses one line; `origin` ("file:line") prefixes every error.
Record parse_record(const std::string& line, const std::string& origin);

/// The longest line a JSON-lines file may hold (256 MiB): one record is
/// never larger, and a file without line breaks is refused at this size
/// instead of filling memory.
constexpr long long kMaxRecordLineBytes = 256LL << 20;

/// Every record of a JSON-lines file, read line by line through the guarded
/// reader (core/file.h). A missing or empty file (no records), one that is
/// not a regular file (a FIFO, a device, a directory) or a line past
/// kMaxRecordLineBytes is a ConfigError naming it.
std::vector<Record> read_jsonl(const std::string& path);

}  // namespace shardtrain::data
