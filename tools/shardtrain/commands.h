// The subcommands of the `shardtrain` tool, one file each.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "shardtrain/config/config.h"
#include "shardtrain/models/causal_lm.h"

namespace shardtrain::data {
class Tokenizer;
}

namespace shardtrain::cli {

/// The whole tool, `shardtrain COMMAND ARGS...` (argv[0] is the program):
/// what main() runs, and what ranks forked by the launcher's fork server run
/// (dist::LaunchOptions::rank_main).
int run_tool(int argc, char** argv);

/// This executable's path (/proc/self/exe), or "" when it cannot be read.
std::string this_program();

/// `shardtrain launch ... -- PROGRAM ARGS`; argv[0] is "launch".
int launch_main(int argc, char** argv);

/// `shardtrain bench-comm --op OP --bytes B ...`; argv[0] is "bench-comm".
int bench_comm_main(int argc, char** argv);

/// `shardtrain train [CONFIG] [--set k=v ...] [launch options as for launch]`.
int train_main(int argc, char** argv);

/// `shardtrain estimate [CONFIG] [--set k=v ...] [--nproc-per-node N] [--nnodes M]`.
int estimate_main(int argc, char** argv);

/// `shardtrain config [CONFIG] [--set k=v ...]`, `--docs FILE`, `--check-docs FILE`.
int config_main(int argc, char** argv);

/// `shardtrain generate --checkpoint PATH --prompt TEXT --max-new-tokens N`.
int generate_main(int argc, char** argv);

/// `shardtrain checkpoint inspect|consolidate|list DIR ...`.
int checkpoint_main(int argc, char** argv);

/// `shardtrain report RUN_DIR... [--out FILE.html]`; argv[0] is "report".
int report_main(int argc, char** argv);

/// `shardtrain tokenize --tokenizer PATH --out FILE INPUT...`: text to a token file.
int tokenize_main(int argc, char** argv);

/// `shardtrain lora merge --base FILE --adapter DIR --out FILE`.
int lora_main(int argc, char** argv);

/// A language model and the config it was built from.
struct LoadedModel {
  std::shared_ptr<models::CausalLMImpl> model;
  config::Config config;
};

/// The language model at `path`: a run directory (its exported model, or
/// its newest complete checkpoint when that is newer), a checkpoint
/// directory, a Hugging Face model directory, or a .safetensors file with
/// config.yaml beside it (checkpoint::resolve_checkpoint); with
/// `say_source`, says on stderr which it read. CheckpointError if there is
/// none or it does not load.
LoadedModel load_model(const std::string& path, bool say_source = false);

/// The tokenizer a loaded model reads: its run's data.tokenizer (for a
/// Hugging Face directory, the directory's own tokenizer, else bytes).
std::shared_ptr<const data::Tokenizer> model_tokenizer(const config::Config& config);

/// Samples after `prompt` and returns prompt + continuation as text.
std::string sample_text(models::CausalLMImpl& model, const data::Tokenizer& tokenizer,
                        const std::string& prompt, const models::GenerateOptions& options);

}  // namespace shardtrain::cli
