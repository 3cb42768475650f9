# The GPT family against the independent PyTorch reference
# (tests/reference/gpt_ref.py), driven by tests/models/gpt_parity.py:
# 10 training steps from weights the reference wrote (the Conv1D file
# layout in, the same layout exported) under one process, tensor
# parallelism and a pipeline (data parallelism alone is checked against the single process
# in tests/dist/test_trainer_parity.cpp).
set(GPT_PARITY /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/gpt_parity.py)

add_test(NAME models.gpt.reference_selfcheck
         COMMAND /usr/bin/python3 ${PROJECT_SOURCE_DIR}/tests/reference/gpt_ref.py selfcheck)

# name strategy [key=value ...]
set(GPT_TRAIN_CASES
  "single single"
  # Tensor parallelism: the fused c_attn split by thirds, c_fc by columns,
  # both c_proj by rows (their biases added once); sequence and loss
  # parallel on by default, both off once; composed with full_shard on the
  # data-parallel ranks.
  "tp2 ddpx2 distributed.tensor_parallel=2"
  "tp2_no_sequence_no_loss_parallel ddpx2 distributed.tensor_parallel=2 distributed.sequence_parallel=false distributed.loss_parallel=false"
  "tp2_full_shard_x2 full_shardx4 distributed.tensor_parallel=2"
  # A pipeline: wte and wpe on the first stage, the tied head (wte again) on
  # the last; the interleaved schedule over 4 stages.
  "pp2 ddpx2 distributed.pipeline_parallel=2"
  "pp2_interleaved ddpx2 distributed.pipeline_parallel=2 distributed.pipeline_schedule=interleaved_1f1b")
foreach(case ${GPT_TRAIN_CASES})
  string(REPLACE " " ";" args ${case})
  list(POP_FRONT args name)
  add_test(NAME models.gpt.train.${name} COMMAND ${GPT_PARITY} train ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ${args})
endforeach()

get_property(gpt_tests DIRECTORY PROPERTY TESTS)
list(FILTER gpt_tests INCLUDE REGEX "^models\\.gpt\\.")
set_tests_properties(${gpt_tests} PROPERTIES TIMEOUT 600)
