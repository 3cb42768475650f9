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

# name variant strategy [bf16] [key=value ...] [+make_arg=value] [clip=x]
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
  "bf16_full_shard_x2 tied_qwen2 full_shardx2 bf16"
  # Tensor parallelism (distributed.tensor_parallel): sequence and loss
  # parallel on by default, both off once, loss parallel alone off once; GQA with kv heads = tp; every
  # projection's bias (row-parallel ones added once) at tp 4; composed with
  # ddp (and activation checkpointing, whose recompute repeats the forward's
  # collectives inside backward), full_shard (with clipping that fires every
  # step: the norm counts each replicated parameter once), hybrid_shard and
  # zero1 on the data-parallel ranks; a tied Qwen2 head with q/k/v biases;
  # bf16-mixed and bf16-true.
  "tp2 gqa_llama3 ddpx2 distributed.tensor_parallel=2"
  "tp2_no_sequence_no_loss_parallel gqa_llama3 ddpx2 distributed.tensor_parallel=2 distributed.sequence_parallel=false distributed.loss_parallel=false"
  "tp2_no_loss_parallel gqa_llama3 ddpx2 distributed.tensor_parallel=2 distributed.loss_parallel=false"
  "tp4_biases biases ddpx4 distributed.tensor_parallel=4 +--num_key_value_heads=4"
  "tp2_ddp_x2_checkpointing gqa_llama3 ddpx4 distributed.tensor_parallel=2 model.activation_checkpointing=true"
  "tp2_full_shard_x2_clip_fires gqa_llama3 full_shardx4 distributed.tensor_parallel=2 clip=0.05"
  "tp2_hybrid_shard_x4 gqa_llama3 hybrid_shardx8 distributed.tensor_parallel=2"
  "tp2_tied_qwen2_zero1 tied_qwen2 zero1x2 distributed.tensor_parallel=2 +--num_key_value_heads=2"
  "bf16_tp2 gqa_llama3 ddpx2 bf16 distributed.tensor_parallel=2"
  "bf16_true_tp2 gqa_llama3 ddpx2 bf16-true distributed.tensor_parallel=2"
  # tensor_parallel auto under a budget only tp 2 fits.
  "tp_auto gqa_llama3 ddpx2 distributed.tensor_parallel=auto"
  # Pipeline parallelism (distributed.pipeline_parallel): two stages under
  # every schedule (4 micro-batches; interleaved cuts the 4 units into 4
  # stages, 2 per rank); 4 stages of a 4-layer model, and with 2
  # micro-batches (fewer than the stages); a tied Qwen2 head split across
  # the ends, under full_shard with clipping that fires (the norm counts the
  # tied weight once); ddp on the data-parallel ranks.
  "pp2_1f1b gqa_llama3 ddpx2 distributed.pipeline_parallel=2"
  "pp2_gpipe gqa_llama3 ddpx2 distributed.pipeline_parallel=2 distributed.pipeline_schedule=gpipe"
  "pp2_interleaved gqa_llama3 ddpx2 distributed.pipeline_parallel=2 distributed.pipeline_schedule=interleaved_1f1b"
  "pp2_zero_bubble gqa_llama3 ddpx2 distributed.pipeline_parallel=2 distributed.pipeline_schedule=zero_bubble"
  "pp4_four_layers gqa_llama3 ddpx4 distributed.pipeline_parallel=4 +--num_hidden_layers=4"
  "pp4_two_micro_batches gqa_llama3 ddpx4 distributed.pipeline_parallel=4 batch.micro=4 +--num_hidden_layers=4"
  "pp2_tied_qwen2_full_shard_x2_clip_fires tied_qwen2 full_shardx4 distributed.pipeline_parallel=2 clip=0.05"
  "pp2_ddp_x2_zero_bubble gqa_llama3 ddpx4 distributed.pipeline_parallel=2 distributed.pipeline_schedule=zero_bubble"
  "bf16_pp2 gqa_llama3 ddpx2 bf16 distributed.pipeline_parallel=2"
  "pp2_split_shard_grad_op_x2 gqa_llama3 shard_grad_opx4 distributed.pipeline_parallel=2 distributed.pipeline_split=[3] +--num_hidden_layers=4"
  "pp2_zero1_x2_checkpointing_zero_bubble gqa_llama3 zero1x4 distributed.pipeline_parallel=2 distributed.pipeline_schedule=zero_bubble model.activation_checkpointing=true"
  # 3-D: pipeline x tensor parallel (sequence and loss parallel), and x data parallel (8 ranks).
  "pp2_tp2 gqa_llama3 ddpx4 distributed.pipeline_parallel=2 distributed.tensor_parallel=2"
  "pp2_tp2_full_shard_x2 gqa_llama3 full_shardx8 distributed.pipeline_parallel=2 distributed.tensor_parallel=2"
  # Measured load balancing (distributed.load_balance): the ranks start at
  # uneven shares and re-plan every 2 steps; each step's rows and loss stay
  # the global batch's, under every data-parallel strategy and the data-
  # parallel dimension of a pipeline.
  "balance_ddp_x2 gqa_llama3 ddpx2 distributed.load_balance=measured distributed.shares=[3,1] distributed.rebalance_every=2"
  "balance_zero1_x2 gqa_llama3 zero1x2 distributed.load_balance=measured distributed.shares=[1,3] distributed.rebalance_every=2"
  "balance_full_shard_x2 gqa_llama3 full_shardx2 distributed.load_balance=measured distributed.shares=[3,1] distributed.rebalance_every=2"
  "balance_hybrid_shard_x4 gqa_llama3 hybrid_shardx4 distributed.load_balance=measured distributed.shares=[3,1,1,2] distributed.rebalance_every=2"
  "balance_pp2_ddp_x2 gqa_llama3 ddpx4 distributed.pipeline_parallel=2 distributed.load_balance=measured distributed.shares=[3,1] distributed.rebalance_every=2")
foreach(case ${LLAMA_TRAIN_CASES})
  string(REPLACE " " ";" args ${case})
  list(POP_FRONT args name)
  add_test(NAME models.llama.train.${name} COMMAND ${LLAMA_PARITY} train ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ${args})
endforeach()

# Masked prompt/completion records packed several to a row (positions
# restarting, attention within each record): the micro-batches the task
# serves train the reference; shardtrain trains them in one process and
# under tensor parallelism (sequence and loss parallel) and a pipeline.
foreach(spec single ddpx2:tp2 ddpx2:pp2)
  string(REPLACE "ddpx2:" "" name ${spec})
  add_test(NAME models.llama.packed.${name}
           COMMAND ${LLAMA_PARITY} packed ${SHARDTRAIN_CLI} $<TARGET_FILE:llama_logits> ${PROJECT_SOURCE_DIR} ${spec})
endforeach()

# Packed masked rows split by measured shares over two data-parallel ranks.
add_test(NAME models.llama.packed.balance
         COMMAND ${LLAMA_PARITY} packed ${SHARDTRAIN_CLI} $<TARGET_FILE:llama_logits> ${PROJECT_SOURCE_DIR} ddpx2:lb3-1)

# A checkpoint saved under measured load balancing resumes with its shares
# (the first resumed step runs with the checkpoint's), and under one process.
add_test(NAME models.llama.reshard_balance
         COMMAND ${LLAMA_PARITY} reshard ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ddpx2:lb3-1 ddpx2:lb3-1 single)

# A checkpoint saved under tp2 x full_shard 2 resumes under one process,
# ddp x4 and tp4 (each piece records its place in the whole tensor).
add_test(NAME models.llama.reshard_tensor_parallel
         COMMAND ${LLAMA_PARITY} reshard ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} full_shardx4:tp2 single ddpx4 ddpx4:tp4)
# Evaluation through the stages (pp2, and pp4 where the loss leaves from the
# fourth rank) against one process; pipeline times and bubble in metrics.
add_test(NAME models.llama.eval_pipeline
         COMMAND ${LLAMA_PARITY} eval ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ddpx2:pp2 ddpx4:pp4)

# A checkpoint saved under pp2 x tp2 resumes under one process, ddp x4 and
# pp4 (each stage saves its layers under the whole model's names).
add_test(NAME models.llama.reshard_pipeline
         COMMAND ${LLAMA_PARITY} reshard ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ddpx4:tp2:pp2 single ddpx4 ddpx4:pp4)

# LoRA from a PEFT adapter the reference wrote; under tensor parallelism the
# adapters split with their layers (with and without sequence parallelism:
# without it, only the partial gradients of the unsplit adapter matrices are
# summed over the tp ranks).
foreach(spec single ddpx2 zero1x2 full_shardx2)
  string(REPLACE "x2" "_x2" name ${spec})
  add_test(NAME models.llama.lora.${name} COMMAND ${LLAMA_PARITY} lora ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ${spec})
endforeach()
# lora.train_bias: all: the exported adapter with the base, in the reference,
# is the trained model.
add_test(NAME models.llama.lora_bias COMMAND ${LLAMA_PARITY} lora_bias ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
add_test(NAME models.llama.lora.tp2 COMMAND ${LLAMA_PARITY} lora ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ddpx2:tp2)
add_test(NAME models.llama.lora.pp2 COMMAND ${LLAMA_PARITY} lora ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} ddpx2:pp2)
add_test(NAME models.llama.lora.tp2_full_shard_x2_no_sequence_parallel
         COMMAND ${LLAMA_PARITY} lora ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR} full_shardx4:tp2
                 distributed.sequence_parallel=false)

get_property(llama_tests DIRECTORY PROPERTY TESTS)
list(FILTER llama_tests INCLUDE REGEX "^models\\.llama\\.")
set_tests_properties(${llama_tests} PROPERTIES TIMEOUT 600)
# The reference's make and train outputs, reused by checks that ask for the
# same ones (llama_parity.py's cached_ref; keyed by the reference's source).
set_tests_properties(${llama_tests} PROPERTIES ENVIRONMENT "SHARDTRAIN_REF_CACHE=${CMAKE_BINARY_DIR}/llama-ref-cache")
