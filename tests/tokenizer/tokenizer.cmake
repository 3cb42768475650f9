# Tokenizer parity: our tokenizer.json implementation against independent
# ones (tests/tokenizer/expected.cjs), token for token. The setup fixture
# installs them from npm into the build tree; each model is a test of its own.
add_executable(tokenizer_parity ${CMAKE_CURRENT_LIST_DIR}/parity.cpp)
target_link_libraries(tokenizer_parity PRIVATE shardtrain GTest::gtest_main)
add_test(NAME tokenizer.parity.setup COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/setup.sh ${CMAKE_BINARY_DIR})
set_tests_properties(tokenizer.parity.setup PROPERTIES FIXTURES_SETUP tokenizer_parity TIMEOUT 900)
foreach(name Llama3 Qwen3 Llama2 Llama2Metaspace Gemma3 Gpt2 Gpt2Encoder ThreadSafeEncode)
  string(TOLOWER ${name} lower)
  add_test(NAME tokenizer.parity.${lower} COMMAND tokenizer_parity --gtest_filter=TokenizerParity.${name})
  set_tests_properties(tokenizer.parity.${lower} PROPERTIES FIXTURES_REQUIRED tokenizer_parity TIMEOUT 300
                       ENVIRONMENT "TOKENIZER_PARITY_DIR=${CMAKE_BINARY_DIR}/tokenizer-parity")
endforeach()

# The unit tests train a small SentencePiece model of their own, in a
# program that does not load LibTorch (tests/tokenizer/make_spm_model.cpp).
find_library(SENTENCEPIECE_TRAIN_LIBRARY sentencepiece_train REQUIRED)
add_executable(make_spm_model ${CMAKE_CURRENT_LIST_DIR}/make_spm_model.cpp)
target_link_libraries(make_spm_model PRIVATE ${SENTENCEPIECE_TRAIN_LIBRARY} ${SENTENCEPIECE_LIBRARY})
add_dependencies(unit_tests make_spm_model)
target_compile_definitions(unit_tests PRIVATE MAKE_SPM_MODEL_PATH="$<TARGET_FILE:make_spm_model>")

# `shardtrain tokenize` with hostile tokenizer.json files: exit 2 and one
# line each (a negative id was a SIGSEGV).
add_test(NAME tokenizer.cli.hostile COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/hostile_cli.sh ${SHARDTRAIN_CLI})
set_tests_properties(tokenizer.cli.hostile PROPERTIES TIMEOUT 120)

# `shardtrain tokenize` on one 24 MiB line: the right tokens within about 3
# bytes of memory per input byte (pre-tokenized pieces are encoded as they
# are cut, not collected first).
add_test(NAME tokenizer.cli.long_document
         COMMAND python3 ${CMAKE_CURRENT_LIST_DIR}/long_document.py ${SHARDTRAIN_CLI})
set_tests_properties(tokenizer.cli.long_document PROPERTIES TIMEOUT 300)
