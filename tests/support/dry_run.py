"""The dry-run tests' model and their world of 16 ranks (TP 2 x PP 4 x DP 2), as tools/dry_run.py's flags."""
MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "1", "--global-batch-size", "16", "--mock-data", "--vocab-size", "1024",
         "--train-iters", "1", "--lr", "1e-4", "--bf16"]
WORLD_16 = MODEL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
                    "--world-size", "16", "--jobs", "2"]
