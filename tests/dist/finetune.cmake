# The chat fine-tuning tour (README): a Llama base pretrained with the
# repository's tokenizer, then QLoRA under FSDP x2 on data/chat.jsonl.
add_test(NAME cli.finetune_chat
         COMMAND ${CMAKE_CURRENT_LIST_DIR}/finetune_chat.sh ${SHARDTRAIN_CLI} ${PROJECT_SOURCE_DIR})
set_tests_properties(cli.finetune_chat PROPERTIES TIMEOUT 600)
