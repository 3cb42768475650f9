# The mixture-of-experts families (mixtral, qwen3_moe) against the
# independent PyTorch reference (tests/reference/moe_ref.py), driven by
# tests/models/moe_parity.py: logits and the KV cache of four variants (with
# llama_logits, which loads any family's directory), then 10 fp32 training
# steps per case VARIANT:STRATEGY[:aux] (losses, aux_loss, gradient norms,
# exported weights). Cases are grouped into few entries: each launch costs.
set(MOE_PARITY /usr/bin/python3 ${CMAKE_CURRENT_LIST_DIR}/moe_parity.py)
add_test(NAME models.moe.logits COMMAND ${MOE_PARITY} logits $<TARGET_FILE:llama_logits> ${PROJECT_SOURCE_DIR})
# One process: each family with the load-balancing loss off (coefficient 0,
# logged only) and on, and an expert that never receives a token; tensor and
# pipeline parallelism refused as not supported yet.
add_test(NAME models.moe.train.single
         COMMAND ${MOE_PARITY} train ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR}
                 mixtral:single mixtral:single:aux qwen3_dense:single:aux mixtral_dead:single
                 refused:distributed.tensor_parallel=2 refused:distributed.pipeline_parallel=2)
# Data parallel, the aux loss off: fsdp full_shard x2, and ddp x2 with the
# starved expert; on: ddp x2 (each rank's forwards weigh 1 / accumulate, the
# gradient average over the ranks completes the mean).
add_test(NAME models.moe.train.data_parallel
         COMMAND ${MOE_PARITY} train ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR}
                 qwen3_norm:full_shardx2 mixtral_dead:ddpx2 mixtral:ddpx2:aux)
set_tests_properties(models.moe.logits models.moe.train.single models.moe.train.data_parallel
                     PROPERTIES TIMEOUT 600)
