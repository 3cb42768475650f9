// `shardtrain tokenize --tokenizer PATH --out FILE INPUT...`: text to a token
// file. Each text file is one document, each line of a JSON-lines file
// (.jsonl) one document (its "text" field). Documents are tokenized on all
// cores, one document per task, and written in input order with the
// tokenizer's EOS between them, so the output does not depend on the number
// of threads.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "core/file.h"
#include "core/json.h"
#include "commands.h"
#include "flags.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/jsonl.h"
#include "shardtrain/data/tokenizer.h"
#include "shardtrain/data/tokens.h"

namespace shardtrain::cli {
namespace {

const char kTokenizeUsage[] =
    "usage: shardtrain tokenize --tokenizer PATH --out FILE [--threads N] [--no-eos]\n"
    "                           [--add-special-tokens] [--quiet] INPUT...\n"
    "\n"
    "Tokenizes INPUT files into one token file (the llm.c layout: version 1 with\n"
    "uint16 tokens when every id is below 65,536, else version 2 with uint32).\n"
    "A text file is one document; a .jsonl file holds one document per line, in\n"
    "its \"text\" field. Documents are tokenized in parallel (one document per\n"
    "task: a single huge text file uses one core) and written in input order,\n"
    "with the tokenizer's EOS between documents (none with --no-eos or for the\n"
    "byte tokenizer).\n"
    "\n"
    "  --tokenizer PATH       tokenizer.json, tokenizer.model, a directory holding\n"
    "                         one, or \"bytes\"\n"
    "  --out FILE             the token file to write\n"
    "  --threads N            worker threads (default: all cores)\n"
    "  --add-special-tokens   each document gets the post-processor's tokens (BOS)\n"
    "  --no-eos               no EOS between documents\n"
    "  --quiet                no progress line\n";

struct Options {
  std::string tokenizer;
  std::string out;
  std::vector<std::string> inputs;
  int threads = 0;
  bool eos = true;
  bool add_special = false;
  bool quiet = false;
  bool help = false;
};

Options parse_tokenize_args(int argc, char** argv) {
  Options o;
  CLI::App app;
  setup_app(app);
  add_text(app, "--tokenizer", o.tokenizer);
  add_text(app, "--out", o.out);
  add_int(app, "--threads", o.threads, 1, 65536, "a positive count of threads");
  app.add_flag_callback("--no-eos", [&o] { o.eos = false; });
  app.add_flag("--add-special-tokens", o.add_special);
  app.add_flag("--quiet", o.quiet);
  app.add_option("inputs", o.inputs)->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  if (parse_flags(app, argc, argv, "tokenize", "unexpected option",
                  "allowed: --tokenizer, --out, --threads, --add-special-tokens, --no-eos, --quiet; "
                  "see shardtrain tokenize --help")) {
    o.help = true;
    return o;
  }
  ST_CHECK(!o.tokenizer.empty(), ConfigError, "no --tokenizer given; hint: --tokenizer path/to/tokenizer.json (or bytes)");
  ST_CHECK(!o.out.empty(), ConfigError, "no --out given; hint: --out data/train.bin");
  ST_CHECK(!o.inputs.empty(), ConfigError, "no INPUT files given; usage: shardtrain tokenize --tokenizer PATH --out FILE INPUT...");
  if (o.threads == 0) o.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return o;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The longest text file read as one document: a file is held whole (one
// task), so this is what one document may cost in memory.
constexpr long long kMaxTextInputBytes = 1LL << 40;

// Every document of every input, in order. Each INPUT goes through the
// guarded reader: a FIFO, a device or a directory is refused, naming it.
std::vector<std::string> read_documents(const std::vector<std::string>& inputs) {
  std::vector<std::string> docs;
  std::string why;
  for (const std::string& path : inputs) {
    if (!ends_with(path, ".jsonl")) {
      std::string text;
      ST_CHECK(::shardtrain::detail::read_regular_file(path, kMaxTextInputBytes, &text, &why),
               ConfigError, "cannot read input '", path, "': ", why,
               "; hint: each INPUT must be a text or .jsonl file");
      docs.push_back(std::move(text));
      continue;
    }
    ::shardtrain::detail::LineReader lines(data::kMaxRecordLineBytes);
    ST_CHECK(lines.open(path, &why), ConfigError, "cannot read input '", path, "': ", why,
             "; hint: each INPUT must be a text or .jsonl file");
    std::string line;
    while (true) {
      const auto status = lines.next(&line, &why);
      if (status == ::shardtrain::detail::LineReader::Status::End) break;
      ST_CHECK(status == ::shardtrain::detail::LineReader::Status::Line, ConfigError,
               "cannot read input '", path, "': ", why, "; hint: one JSON object per line");
      const long long n = lines.line_number();
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = ::shardtrain::detail::parse_json_text(line);
      } catch (const nlohmann::json::exception& e) {
        ST_CHECK(false, ConfigError, path, ":", n, " is not JSON: ", e.what(), "; hint: one JSON object per line");
      }
      ST_CHECK(j.is_object() && j.contains("text") && j.at("text").is_string(), ConfigError, path, ":", n,
               " has no string field \"text\"; hint: each line must be an object like {\"text\": \"...\"}");
      docs.push_back(j.at("text").get<std::string>());
    }
  }
  return docs;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int tokenize_main(int argc, char** argv) {
  const Options o = parse_tokenize_args(argc, argv);
  if (o.help) {
    std::printf("%s", kTokenizeUsage);
    return 0;
  }
  const auto tokenizer = data::load_tokenizer(o.tokenizer);
  std::vector<std::string> docs = read_documents(o.inputs);
  int64_t total_bytes = 0;
  for (const auto& d : docs) total_bytes += static_cast<int64_t>(d.size());

  // ---- encode: workers take documents in turn; results stay per document.
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<int64_t> done_bytes{0};
  std::atomic<bool> failed{false};
  const int threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(o.threads), std::max<size_t>(1, docs.size())));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(threads));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      try {
        for (size_t i; (i = next++) < docs.size();) {
          ids[i] = tokenizer->encode(docs[i], o.add_special);
          done_bytes += static_cast<int64_t>(docs[i].size());
          std::string().swap(docs[i]);  // its text is no longer needed
          ++done;
        }
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
        next = docs.size();  // the others stop too
        failed = true;
      }
    });
  }
  // ---- progress, from this thread, until the workers finish.
  while (done < docs.size() && !failed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (!o.quiet) {
      const double s = seconds_since(t0);
      std::fprintf(stderr, "\rtokenize: %zu/%zu documents, %.1f/%.1f MB, %.1f MB/s   ", done.load(), docs.size(),
                   done_bytes / 1e6, total_bytes / 1e6, s > 0 ? done_bytes / 1e6 / s : 0.0);
    }
  }
  for (auto& w : workers) w.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const double encode_s = seconds_since(t0);
  if (!o.quiet) std::fprintf(stderr, "\n");

  // ---- write in input order, EOS between documents (at the end of each
  // but the last), from the documents' own vectors.
  const std::optional<int32_t> eos = o.eos ? tokenizer->eos_id() : std::nullopt;
  size_t count = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (eos && i + 1 < ids.size()) ids[i].push_back(*eos);
    count += ids[i].size();
  }
  ST_CHECK(count > 0, ConfigError, "the inputs hold no tokens (", docs.size(),
           " documents, all empty); hint: check the INPUT files");
  const int width = data::write_token_runs(o.out, ids);
  std::printf("tokenize: %zu documents, %zu tokens, %.2f MB of text in %.2f s: %.2f MB/s on %d threads "
              "(%s tokenizer, vocabulary %lld, EOS %s) -> %s (%d-byte tokens)\n",
              docs.size(), count, total_bytes / 1e6, encode_s, encode_s > 0 ? total_bytes / 1e6 / encode_s : 0.0,
              threads, tokenizer->kind().c_str(), static_cast<long long>(tokenizer->vocab_size()),
              eos ? std::to_string(*eos).c_str() : "none", o.out.c_str(), width);
  return 0;
}

}  // namespace shardtrain::cli
