# Sourced by the examples/pretrain_*.sh scripts: launch pretrain.py on a SLURM allocation (srun, one task
# per GPU) or on hosts from a DeepSpeed hostfile, or only plan the run with tools/plan.py or check its start-up with
# tools/dry_run.py.
#
# The sourcing script defines NODES, GPUS_PER_NODE, DEVICE, VOCAB_SIZE and the flag arrays MODEL_ARGS,
# PARALLEL_ARGS, BATCH_ARGS (what tools/plan.py also reads) and TRAIN_ARGS, DS_ARGS (training only), then
# calls `launch`. Environment:
#   PLAN=1            print tools/plan.py's plan for these flags on NODES x GPUS_PER_NODE DEVICEs (no GPU needed)
#   DRY_RUN=1         run tools/dry_run.py on these flags: every pipeline stage's start-up on a fake process group of
#                     NODES x GPUS_PER_NODE ranks, checked against the plan (no GPU needed; extra arguments such as
#                     --step, --ranks all or --jobs 2 go to it)
#   PRINT_ARGS=1      print the arguments (NUL-separated) of pretrain.py, or with PLAN=1 of tools/plan.py; run nothing
#   HOSTFILE=path     launch with `deepspeed --hostfile` ("hostname slots=8" lines) instead of srun
#   DATA_PATH=prefix  a preprocessed dataset (tools/preprocess_data.py); unset: --mock-data
#   CHECKPOINT_DIR    where to --save / --load (default checkpoints/<script name>)
#   PYTHON            interpreter (default python)

PYTHON=${PYTHON:-python}

data_args() {
    if [[ -n "${DATA_PATH:-}" ]]; then
        DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1 "${TOKENIZER_ARGS[@]}")
    else
        echo "DATA_PATH is not set: training on --mock-data (synthetic tokens; a throughput run)" >&2
        DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "$VOCAB_SIZE")
    fi
}

checkpoint_and_log_args() {
    local name
    name=${NAME:-$(basename "$0" .sh)}
    CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$name}
    OUTPUT_ARGS=(--save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 500 --exit-signal-handler
                 --log-interval 1 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "runs/$name")
}

plan() {
    local plan_args=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${BATCH_ARGS[@]}" --vocab-size "$VOCAB_SIZE"
                     --world-size $((NODES * GPUS_PER_NODE)) --gpus-per-node "$GPUS_PER_NODE" --device "$DEVICE" "$@")
    if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
        printf '%s\0' "${plan_args[@]}"
        exit 0
    fi
    exec "$PYTHON" tools/plan.py "${plan_args[@]}"
}

launch_srun() {
    MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
    export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-6000}
    # one task per GPU; torch.distributed reads RANK/WORLD_SIZE/LOCAL_RANK, SLURM provides the values
    srun --nodes "$NODES" --ntasks-per-node "$GPUS_PER_NODE" --kill-on-bad-exit=1 bash -c '
        export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
        exec "$0" pretrain.py "$@"' "$PYTHON" "${ALL_ARGS[@]}"
}

launch_hostfile() {
    MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE")}
    exec deepspeed --hostfile "$HOSTFILE" --num_nodes "$NODES" --num_gpus "$GPUS_PER_NODE" \
        --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-6000}" pretrain.py "${ALL_ARGS[@]}"
}

launch() {
    if [[ "${PLAN:-0}" == 1 ]]; then
        plan "$@"
    fi
    data_args
    checkpoint_and_log_args
    ALL_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${BATCH_ARGS[@]}" "${TRAIN_ARGS[@]}" "${DATA_ARGS[@]}"
              "${OUTPUT_ARGS[@]}" "${DS_ARGS[@]}" "$@")
    if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
        printf '%s\0' "${ALL_ARGS[@]}"
        exit 0
    elif [[ "${DRY_RUN:-0}" == 1 ]]; then
        exec "$PYTHON" tools/dry_run.py "${ALL_ARGS[@]}" --world-size $((NODES * GPUS_PER_NODE)) \
            --gpus-per-node "$GPUS_PER_NODE" --device "$DEVICE"
    elif [[ -n "${HOSTFILE:-}" ]]; then
        launch_hostfile
    elif [[ -n "${SLURM_JOB_ID:-}" ]]; then
        launch_srun
    else
        echo "not inside a SLURM allocation and no HOSTFILE given: sbatch this script, set HOSTFILE=path," \
             "PLAN=1 to print the plan, or DRY_RUN=1 to check the start-up of every stage" >&2
        exit 2
    fi
}
