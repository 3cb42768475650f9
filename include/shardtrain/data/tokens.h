// Token data: a byte-level tokenizer, token sources read from text or from
// llm.c / nanoGPT token files (read with pread), and the sampler that turns
// them into micro-batches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardtrain::data {

/// Bytes are tokens: vocabulary 256, lossless for any UTF-8 text.
class ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;
  static std::vector<int64_t> encode(const std::string& text);
  /// Ids outside 0..255 throw ConfigError.
  static std::string decode(const std::vector<int64_t>& ids);
};

/// The token-file layout of llm.c / nanoGPT: 256 int32 header words (magic
/// 20240520, version, token count, token width, rest zero), then count
/// tokens. Version 1: uint16 tokens (GPT-2 vocabularies; word 3 is zero).
/// Version 2: word 3 is the token width in bytes, 2 (uint16) or 4 (uint32,
/// vocabularies past 65,536 ids such as Llama-3's); llm.c's version-2 files
/// leave it zero and hold uint32 tokens, so zero reads as 4.
constexpr int32_t kTokenFileMagic = 20240520;
constexpr int32_t kTokenFileVersion = 1;
constexpr int32_t kTokenFileVersionWide = 2;

/// Writes `tokens` in the version-1 layout (for tools and tests).
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);
/// Writes `tokens` in the narrowest layout that holds them: version 1 when
/// every id is below 65,536 (readable by llm.c and older readers), else
/// version 2 with 4-byte tokens. Negative ids are an InvalidArgument.
/// Returns the token width written (2 or 4).
int write_token_file_v2(const std::string& path, const std::vector<int32_t>& tokens);
/// The same for tokens given as consecutive runs (`shardtrain tokenize`'s
/// documents), written from the runs' own memory: a version-1 file narrows
/// each run to uint16 in place, so the runs hold garbage afterwards. The
/// tokens cost their 4 bytes each and nothing more.
int write_token_runs(const std::string& path, std::vector<std::vector<int32_t>>& runs);

/// A read-only sequence of token ids. Token files are read with pread as
/// tokens are asked for (a file truncated meanwhile is an IoError naming it,
/// not a SIGBUS); text is read and byte-tokenized. Copies share the
/// underlying storage.
class TokenSource {
 public:
  /// A token file (version 1 or 2) when the first word is kTokenFileMagic,
  /// UTF-8 text otherwise. A missing, empty or truncated file, or a token
  /// file of another version or width, is a ConfigError naming it.
  static TokenSource open(const std::string& path);
  static TokenSource from_text(const std::string& text);
  static TokenSource from_tokens(std::vector<uint16_t> tokens);

  int64_t size() const { return end_ - begin_; }
  /// Tokens [begin, end) of this source, sharing storage.
  TokenSource slice(int64_t begin, int64_t end) const;
  /// Copies `count` tokens from `start` into `out` as int64.
  void copy_to(int64_t start, int64_t count, int64_t* out) const;
  /// Largest id present (to check it against the model's vocabulary).
  int64_t max_token() const;
  /// Where the tokens came from, for messages.
  const std::string& origin() const { return origin_; }

 private:
  struct Storage;
  TokenSource(std::shared_ptr<const Storage> storage, int64_t begin, int64_t end, std::string origin);
  std::shared_ptr<const Storage> storage_;
  int64_t begin_ = 0;
  int64_t end_ = 0;
  std::string origin_;
};

/// Inputs and next-token targets, both [B, T] int64. Targets equal to the
/// ignore index (-100) carry no loss (prompts, padding).
///
/// Packed rows hold several samples: `segment` [B, T] int64 numbers them
/// within the row (attention never crosses from one segment to another) and
/// `position` [B, T] int64 restarts at 0 with each sample. Both undefined:
/// one sample per row at positions 0..T-1.
struct Batch {
  at::Tensor input;
  at::Tensor target;
  at::Tensor position;
  at::Tensor segment;
};

/// Splits a source into training windows and serves them in a fixed global
/// order.
///
/// A window is block_size + 1 tokens starting at a multiple of block_size, as
/// in llm.c's loader. Epoch e visits the windows in a permutation drawn from
/// (seed, e), or in order when shuffle is off; an epoch is the largest whole
/// number of global batches. Global batch s is windows [s*G, (s+1)*G) of that
/// order (G = global batch size), so the sequence of global batches depends
/// only on the seed and G, never on the world size or on the micro/
/// accumulation split. Within step s, micro-step j on rank k, row r is window
/// (j*W + k)*B + r of the step (W world size, B micro batch): in sequential
/// order its first token is ((s*A + j)*W*B + k*B + r)*T.
class WindowSampler {
 public:
  /// Throws ConfigError when the source holds fewer than G windows.
  WindowSampler(TokenSource tokens, int64_t block_size, int64_t global_batch, uint64_t seed,
                bool shuffle);

  int64_t num_windows() const { return num_windows_; }
  int64_t steps_per_epoch() const { return num_windows_ / global_batch_; }
  /// Epoch of global optimizer step `step` (steps count from 0 across epochs).
  int64_t epoch_of(int64_t step) const { return step / steps_per_epoch(); }

  /// The micro-batch of micro-step `micro_step` of optimizer step `step` for
  /// `rank` of `world_size`, `micro_batch` rows. micro_batch * world_size *
  /// accumulation must equal the global batch (checked by the caller).
  Batch micro_batch(int64_t step, int64_t micro_step, int64_t micro_batch, int rank,
                    int world_size) const;
  /// Rows [first, first + count) of step `step`'s global batch, in the
  /// order of its micro-steps and ranks; count 0 gives a batch of no rows.
  Batch step_rows(int64_t step, int64_t first, int64_t count) const;

 private:
  // Window index (into the source) of position `i` of epoch `epoch`'s order.
  int64_t window_at(int64_t epoch, int64_t i) const;

  TokenSource tokens_;
  int64_t block_size_;
  int64_t global_batch_;
  uint64_t seed_;
  bool shuffle_;
  int64_t num_windows_;
  // The last epoch's permutation, cached (recomputed when the epoch changes).
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

}  // namespace shardtrain::data
