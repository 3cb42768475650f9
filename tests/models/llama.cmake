# The Llama family against the independent PyTorch reference
# (tests/reference/llama_ref.py), driven by tests/models/llama_parity.py:
# logits and the KV cache, 10 training steps under every strategy and in
# bf16-mixed, export and reload, LoRA adapters in the PEFT layout.
add_executable(llama_logits ${CMAKE_CURRENT_LIST_DIR}/llama_logits.cpp)
target_link_libraries(llama_logits PRIVATE shardtrain)
shardtrain_use_pch(llama_logits)
set(LLAMA_PARITY /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/llama_parity.py)

add_test(NAME models.llama.reference_selfcheck
         COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/reference/test_llama_ref.py)
add_test(NAME models.llama.logits COMMAND ${LLAMA_PARITY} logits $<TARGET_FILE:llama_logits> ${PROJECT_SOURCE_DIR})
add_test(NAME models.llama.export COMMAND ${LLAMA_PARITY} export ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})

# name variant strategy [bf16]
set(LLAMA_TRAIN_CASES
  "single gqa_llama3 single"
  "ddp_x2 gqa_llama3 ddpx2"
  "zero1_x2 gqa_llama3 zero1x2"
  "full_shard_x2 gqa_llama3 full_shardx2"
  "hybrid_shard_x4 gqa_llama3 hybrid_shardx4"
  "tied_qwen2_full_shard_x2 tied_qwen2 full_shardx2"
  "tied_qwen2_ddp_x2 tied_qwen2 ddpx2"
  "mistral_head_dim_zero1_x2 mistral_head_dim zero1x2"
  "biases_full_shard_x2 biases full_shardx2"
  "bf16_ddp_x2 gqa_llama3 ddpx2 bf16"
  "bf16_full_shard_x2 tied_qwen2 full_shardx2 bf16")
foreach(case ${LLAMA_TRAIN_CASES})
  string(REPLACE " " ";" args ${case})
  list(POP_FRONT args name)
  add_test(NAME models.llama.train.${name} COMMAND ${LLAMA_PARITY} train ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ${args})
endforeach()

# LoRA from a PEFT adapter the reference wrote.
foreach(spec single ddpx2 zero1x2 full_shardx2)
  string(REPLACE "x2" "_x2" name ${spec})
  add_test(NAME models.llama.lora.${name} COMMAND ${LLAMA_PARITY} lora ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ${spec})
endforeach()

get_property(llama_tests DIRECTORY PROPERTY TESTS)
list(FILTER llama_tests INCLUDE REGEX "^models\\.llama\\.")
set_tests_properties(${llama_tests} PROPERTIES TIMEOUT 600)
