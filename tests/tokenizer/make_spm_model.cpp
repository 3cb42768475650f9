// Trains a small SentencePiece model for the unit tests:
//   make_spm_model INPUT.txt MODEL_PREFIX VOCAB_SIZE
// A program of its own because libsentencepiece_train (and the protobuf-lite
// copy inside libsentencepiece) must not be loaded beside LibTorch's
// libprotobuf (src/data/sentencepiece/module.cpp).
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: make_spm_model INPUT.txt MODEL_PREFIX VOCAB_SIZE\n");
    return 2;
  }
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      std::string("--input=") + argv[1] + " --model_prefix=" + argv[2] + " --vocab_size=" + argv[3] +
      " --model_type=bpe --byte_fallback=true --minloglevel=2");
  if (!status.ok()) {
    std::fprintf(stderr, "make_spm_model: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
