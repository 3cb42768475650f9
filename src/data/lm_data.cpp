// make_lm_data: the format chosen once, then token windows or sample rows.
#include "shardtrain/data/lm_data.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/file.h"
#include "shardtrain/core/error.h"
#include "shardtrain/data/chat_template.h"
#include "shardtrain/data/packing.h"
#include "shardtrain/data/row_sampler.h"
#include "shardtrain/data/samples.h"
#include "shuffle.h"

namespace shardtrain::data {

namespace {

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// False too when it cannot be read: the reader that follows names why.
bool starts_with_token_magic(const std::string& path) {
  std::string head, why;
  int32_t magic = 0;
  if (!shardtrain::detail::read_regular_prefix(path, sizeof(magic), &head, &why) ||
      head.size() != sizeof(magic)) {
    return false;
  }
  std::memcpy(&magic, head.data(), sizeof(magic));
  return magic == kTokenFileMagic;
}

DataFormat detect_format(const config::DataConfig& c) {
  if (c.format != DataFormat::Auto) return c.format;
  if (ends_with(c.train, ".jsonl")) return DataFormat::Jsonl;
  return starts_with_token_magic(c.train) ? DataFormat::Tokens : DataFormat::Text;
}

// The token stream of a tokens or text source. Text goes through the
// tokenizer unless it is bytes (then TokenSource reads the bytes itself).
TokenSource open_tokens(const config::DataConfig& c, DataFormat format, const Tokenizer& tok) {
  const bool is_tokens = starts_with_token_magic(c.train);
  if (format == DataFormat::Tokens) {
    ST_CHECK(is_tokens, ConfigError, "data.train '", c.train, "' is not a token file (no magic ",
             kTokenFileMagic, " in its first word); hint: set data.format to text or auto");
    return TokenSource::open(c.train);
  }
  if (tok.kind() == "bytes" && !is_tokens) return TokenSource::open(c.train);
  std::string text, why;
  ST_CHECK(shardtrain::detail::read_regular_file(c.train, 1LL << 40, &text, &why), ConfigError,
           "cannot read data.train '", c.train, "': ", why);
  ST_CHECK(tok.vocab_size() <= 65536, ConfigError, "data.format=text with tokenizer '",
           c.tokenizer, "' (", tok.vocab_size(), " ids) does not fit 16-bit token windows; hint: "
           "use data.format=jsonl with {\"text\": ...} records");
  std::vector<uint16_t> ids;
  for (const int32_t id : tok.encode(text)) ids.push_back(static_cast<uint16_t>(id));
  ST_CHECK(!ids.empty(), ConfigError, "data.train '", c.train, "' is empty");
  return TokenSource::from_tokens(std::move(ids));
}

// Today's path: windows of a token stream, the last val_fraction held out.
LmData token_data(const config::DataConfig& c, DataFormat format, const Tokenizer& tok,
                  int64_t block_size, int64_t global_batch, int64_t eval_rows, uint64_t seed) {
  const TokenSource all = open_tokens(c, format, tok);
  const int64_t window = block_size + 1;
  int64_t n_val = 0;
  if (c.val_fraction > 0) {
    n_val = std::max(static_cast<int64_t>(static_cast<double>(all.size()) * c.val_fraction),
                     eval_rows * block_size + 1);
    ST_CHECK(n_val < all.size() - window, ConfigError, "data.val_fraction ", c.val_fraction,
             " leaves too little of '", c.train, "' to train on; lower it or use more data");
  }
  auto sampler = std::make_shared<WindowSampler>(all.slice(0, all.size() - n_val), block_size,
                                                 global_batch, seed, c.shuffle);
  LmData d;
  d.stats.format = format == DataFormat::Tokens ? "tokens" : "text";
  d.stats.train_samples = d.stats.train_rows = sampler->num_windows();
  d.stats.max_token = all.max_token();
  d.train_batch = [sampler](int64_t step, int64_t j, int64_t micro, int rank, int world) {
    return sampler->micro_batch(step, j, micro, rank, world);
  };
  d.train_rows = [sampler](int64_t step, int64_t first, int64_t count) {
    return sampler->step_rows(step, first, count);
  };
  d.epoch_of = [sampler](int64_t step) { return sampler->epoch_of(step); };
  if (n_val > 0) {
    // Evaluation batch i is the i-th block of micro x world windows, in order.
    auto val = std::make_shared<WindowSampler>(all.slice(all.size() - n_val, all.size()),
                                               block_size, eval_rows, seed, false);
    d.stats.val_samples = d.stats.val_rows = val->num_windows();
    d.eval_batch = [val](int64_t index, int64_t micro, int rank, int world) {
      return val->micro_batch(index, 0, micro, rank, world);
    };
  }
  return d;
}

int64_t max_id(const std::vector<Sample>& samples) {
  int64_t best = -1;
  for (const Sample& s : samples) {
    for (const int32_t id : s.ids) best = std::max<int64_t>(best, id);
  }
  return best;
}

// How records become samples: the chat template, and whether prompts train.
SampleOptions sample_options(const config::DataConfig& c, const std::string& model_dir) {
  SampleOptions options;
  try {
    options.chat_template = resolve_chat_template(c.chat_template, model_dir);
  } catch (const ConfigError& e) {
    // Only chat records need a template: the first one reports this.
    if (c.chat_template != ChatTemplateKind::Auto) throw;
    options.chat_template = ChatTemplateKind::Auto;
    options.no_template = e.what();
  }
  options.train_on_inputs = c.train_on_inputs;
  return options;
}

// Records with nothing to train on (a chat with no assistant turn, a
// prompt-only record under train_on_inputs false) are left out and
// counted: a step of only such rows has no target to divide by, and an
// evaluation of them is 0/0. `*records_out` is how many records there were.
std::vector<Sample> trainable_samples(const config::DataConfig& c, const Tokenizer& tok,
                                      const SampleOptions& options, int64_t* records_out) {
  std::vector<Sample> samples = load_samples(c.train, tok, options);
  const auto records = static_cast<int64_t>(samples.size());
  samples.erase(std::remove_if(samples.begin(), samples.end(),
                               [](const Sample& s) {
                                 return std::none_of(s.trained.begin() + std::min<size_t>(1, s.trained.size()),
                                                     s.trained.end(), [](uint8_t t) { return t != 0; });
                               }),
                samples.end());
  const auto n = static_cast<int64_t>(samples.size());
  ST_CHECK(records == 0 || n > 0, ConfigError, "none of the ", records, " records of '", c.train,
           "' has a token to train on (each is masked whole: a chat without an assistant turn, or a prompt "
           "without a completion); hint: check the records, or set data.train_on_inputs: true to train on "
           "the prompts too");
  *records_out = records;
  return samples;
}

// How many of the n records (the last ones, whole) are held out.
int64_t held_out_records(const config::DataConfig& c, int64_t n) {
  int64_t n_val = 0;
  if (c.val_fraction > 0) {
    n_val = std::max<int64_t>(1, std::llround(static_cast<double>(n) * c.val_fraction));
    ST_CHECK(n_val < n, ConfigError, "data.val_fraction ", c.val_fraction, " of the ", n,
             " records of '", c.train, "' leaves none to train on; lower it or use more data");
  }
  return n_val;
}

// Packing runs once, over the training samples in an order drawn from the
// seed (file order without shuffle); the epochs then shuffle the rows.
std::vector<int64_t> packing_order(const config::DataConfig& c, int64_t n_train, uint64_t seed) {
  std::vector<int64_t> order = c.shuffle ? detail::permutation(n_train, seed ^ 0x7061636bULL, 0)
                                         : std::vector<int64_t>();
  if (!c.shuffle) {
    for (int64_t i = 0; i < n_train; ++i) order.push_back(i);
  }
  return order;
}

// The training rows, served in the global order.
void serve_training_rows(LmData& d, const config::DataConfig& c, const Rows& train,
                         int64_t global_batch, uint64_t seed) {
  auto sampler = std::make_shared<RowSampler>(train, global_batch, seed, c.shuffle,
                                              "data.train '" + c.train + "'");
  d.stats.train_samples = train.samples;
  d.stats.train_rows = train.count;
  d.stats.truncated = train.truncated;
  d.stats.dropped = train.dropped;
  d.stats.packing_efficiency = train.efficiency();
  d.train_batch = [sampler](int64_t step, int64_t j, int64_t micro, int rank, int world) {
    return sampler->micro_batch(step, j, micro, rank, world);
  };
  d.train_rows = [sampler](int64_t step, int64_t first, int64_t count) {
    return sampler->step_rows(step, first, count);
  };
  d.epoch_of = [sampler](int64_t step) { return sampler->epoch_of(step); };
}

// The held-out records [first, samples.size()) built into rows and served as
// evaluation batches, at least one of them.
void serve_held_out_rows(LmData& d, const config::DataConfig& c,
                         const std::vector<Sample>& samples, int64_t first, int64_t block_size,
                         int64_t eval_rows, uint64_t seed, int64_t pad) {
  std::vector<int64_t> held;
  for (int64_t i = first; i < static_cast<int64_t>(samples.size()); ++i) held.push_back(i);
  const Rows val = build_rows(samples, held, block_size, c.packing, c.overlong, pad);
  d.stats.val_samples = val.samples;
  d.stats.val_rows = val.count;
  d.stats.truncated += val.truncated;
  d.stats.dropped += val.dropped;
  ST_CHECK(val.count >= eval_rows, ConfigError, "data.val_fraction ", c.val_fraction, " of '",
           c.train, "' holds ", val.count, " rows, fewer than one evaluation batch of ",
           eval_rows, " (batch.micro x ranks); hint: raise data.val_fraction");
  auto rows = std::make_shared<RowSampler>(val, eval_rows, seed, false, "validation");
  const int64_t batches = val.count / eval_rows;
  d.eval_batch = [rows, batches](int64_t index, int64_t micro, int rank, int world) {
    return rows->rows((index % batches) * micro * world + rank * micro, micro);
  };
}

// Records tokenized and masked, the last val_fraction of them (whole) held
// out, rows built and served in the global order.
LmData sample_data(const config::DataConfig& c, const Tokenizer& tok, int64_t block_size,
                   int64_t global_batch, int64_t eval_rows, uint64_t seed,
                   const std::string& model_dir) {
  int64_t records = 0;
  const std::vector<Sample> samples =
      trainable_samples(c, tok, sample_options(c, model_dir), &records);
  const auto n = static_cast<int64_t>(samples.size());
  const int64_t n_val = held_out_records(c, n);
  const std::vector<int64_t> order = packing_order(c, n - n_val, seed);
  const int64_t pad = tok.eos_id().value_or(0);
  const Rows train = build_rows(samples, order, block_size, c.packing, c.overlong, pad);
  LmData d;
  d.stats.format = "jsonl";
  serve_training_rows(d, c, train, global_batch, seed);
  d.stats.untrained = records - n;
  d.stats.max_token = max_id(samples);
  if (n_val > 0) serve_held_out_rows(d, c, samples, n - n_val, block_size, eval_rows, seed, pad);
  return d;
}

}  // namespace

std::string LmDataStats::summary() const {
  std::ostringstream s;
  s << "data: " << format << ", " << train_samples << " training samples in " << train_rows
    << " rows, " << val_samples << " held out in " << val_rows << " rows";
  if (format == "jsonl") {
    s << ", " << truncated << " truncated, " << dropped << " dropped, packing efficiency "
      << std::round(packing_efficiency * 1000.0) / 10.0 << "%";
    if (untrained > 0) s << "; " << untrained << " records with no token to train on left out";
  }
  return s.str();
}

LmData make_lm_data(const config::DataConfig& config, const Tokenizer& tokenizer,
                    int64_t block_size, int64_t global_batch, int64_t eval_rows, uint64_t seed,
                    const std::string& model_dir) {
  const DataFormat format = detect_format(config);
  if (format == DataFormat::Jsonl) {
    return sample_data(config, tokenizer, block_size, global_batch, eval_rows, seed, model_dir);
  }
  return token_data(config, format, tokenizer, block_size, global_batch, eval_rows, seed);
}

}  // namespace shardtrain::data
