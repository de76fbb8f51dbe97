"""Data: Megatron's indexed datasets, GPT samples and blends, the sampler, tokenizers.

    indexed_dataset.py  Megatron-LM's memory-mapped indexed dataset (.bin and .idx), byte for byte
    gpt_dataset.py      GPT samples over an indexed dataset, with Megatron-LM's semantics
    blended_dataset.py  a weighted blend of datasets, Megatron-LM's greedy interleaving
    index_helpers.py    the GPT and blended index arrays: built (helpers.cpp) and cached on disk
    samplers.py         Megatron's pretraining sampler: the global sample position is the data position
    mock.py             a deterministic synthetic token stream (--mock-data)
    builder.py          from the data flags to each rank's micro-batch iterators
    tokenizers/         tokenizers by Megatron's --tokenizer-type names
"""
