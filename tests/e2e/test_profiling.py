"""--profile --use-pytorch-profiler records exactly the requested iterations on the requested ranks."""
import json

from tests.support.launch import assert_succeeded, launch

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 "
         "--global-batch-size 2 --mock-data --vocab-size 128 --log-interval 1 --eval-interval 0").split()


def test_pytorch_profiler_writes_trace_for_selected_rank_and_window(tmp_path):
    flags = MODEL + ["--tensor-model-parallel-size", "2", "--train-iters", "4", "--profile", "--use-pytorch-profiler",
                     "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "1",
                     "--profile-dir", str(tmp_path)]
    result = launch(2, flags)
    assert_succeeded(result, tail=3000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile_rank1_iterations2-3.json"]
    trace = json.loads((tmp_path / "profile_rank1_iterations2-3.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::mm" in names and "ProfilerStep" not in names
    assert "megatron_ds [rank 1]: profile of iterations 2-3" in result.stdout
    assert "megatron_ds [rank 0]: profile" not in result.stdout
    table = result.stdout.split("profile of iterations 2-3")[1]
    assert "Self CPU" in table and "aten::" in table
