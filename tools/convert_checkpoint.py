"""Reshape megatron_ds checkpoints to another tensor/pipeline-parallel layout, and convert them to and from
Hugging Face `transformers` models (GPT-2 family <-> GPT2LMHeadModel, LLaMA family <-> LlamaForCausalLM, with
experts in every layer <-> MixtralForCausalLM, with --add-qkv-bias <-> Qwen2ForCausalLM, with --qk-layernorm <->
Qwen3ForCausalLM). One process, CPU only, no download.

    # another layout (any data-parallel size loads the result); optimizer states reshaped too unless --no-optim
    python tools/convert_checkpoint.py --load ckpt --save ckpt_tp1_pp2 \\
        --target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 2
    # to Hugging Face (safetensors + config.json + tokenizer files when the run had a tokenizer)
    python tools/convert_checkpoint.py --to-hf --load ckpt --save hf_model
    # from Hugging Face, for pretrain.py --load ckpt_from_hf --finetune
    python tools/convert_checkpoint.py --from-hf hf_model --save ckpt_from_hf \\
        --target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2
    # a Mixtral into the dropless MoE layer (Megatron-Core's MoE flags; default --moe-layer deepspeed-moe)
    python tools/convert_checkpoint.py --from-hf mixtral --save ckpt_dropless --moe-layer dropless
    # from and back to Megatron-DeepSpeed's checkpoints (weights, optimizer states, data position, LR schedule)
    python tools/convert_checkpoint.py --from-megatron-deepspeed mds_ckpt --save ckpt_from_mds
    python tools/convert_checkpoint.py --to-megatron-deepspeed --load ckpt --save mds_ckpt
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ds.launch.runtime import prepare_host  # noqa: E402

prepare_host()  # DeepSpeed (imported by the readers) picks its accelerator at import time

from megatron_ds.conversion.convert_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
