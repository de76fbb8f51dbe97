"""tools/dry_run.py: pretrain.py's start-up of chosen ranks of a world this machine does not have, each in its
own process on torch's fake process group, checked against each other and the planner. The worlds are small
enough to work out by hand (16 ranks, TP 2 x PP 4 x DP 2; an MoE and a Ulysses world of 8), the faults are
injected for real: a sitecustomize on the ranks' PYTHONPATH makes one rank create one process group more than the
others."""
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from megatron_ds.planning.dry_run import step_checks
from tests.support.dry_run import MODEL, WORLD_16
from tests.support.launch import assert_succeeded

REPO = Path(__file__).resolve().parents[3]


def dry(flags, environment=None):
    return subprocess.run([sys.executable, "tools/dry_run.py", *flags], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(environment or {})}, timeout=900)


def stepped_as_planned(tmp_path, flags):
    """The records of a --step dry run of `flags` that passed every check."""
    result = dry(flags + ["--world-size", "8", "--jobs", "2", "--step", "--json", str(tmp_path / "dry.json")])
    assert_succeeded(result, tail=None)
    assert "traffic and memory as planned, memory within the device" in result.stdout
    return json.loads((tmp_path / "dry.json").read_text())["ranks"]


def sitecustomize(tmp_path, source):
    """A folder whose sitecustomize.py runs `source` in every process started with it on PYTHONPATH."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(source))
    return hook


def layer_parameters(h, tp):
    """One GPT layer on one TP rank: QKV and fc1 split with their biases, dense and fc2 split (their biases
    whole), two LayerNorms."""
    return (3 * h * h + 3 * h) // tp + (h * h) // tp + h + 2 * 2 * h + (4 * h * h + 4 * h) // tp + (4 * h * h) // tp + h


def test_every_stage_of_a_16_rank_world_starts_up_and_steps_as_planned(tmp_path):
    result = dry(WORLD_16 + ["--step", "--json", str(tmp_path / "dry.json")])
    assert_succeeded(result, tail=None)
    assert "covered 8 of 8 (pipeline stage, TP position) classes with 8 ranks" in result.stdout
    assert "12 sending pairs (0 whose receiver did not run)" in result.stdout
    assert "traffic and memory as planned, memory within the device" in result.stdout
    records = json.loads((tmp_path / "dry.json").read_text())["ranks"]
    assert sorted(map(int, records)) == [0, 1, 4, 5, 8, 9, 12, 13]   # data-parallel replica 0
    # rank = pipe x 4 + data x 2 + tp: rank 5 is stage 1, replica 0, TP rank 1
    assert records["5"]["groups"]["ours"] == {"tensor": [4, 5], "data": [5, 7], "pipeline": [1, 5, 9, 13],
                                              "sequence": [5], "sequence-data": [5, 7]}
    assert records["5"]["groups"]["deepspeed"] == {"tensor": [4, 5], "data": [5, 7], "pipeline": [1, 5, 9, 13]}
    two_layers = 2 * layer_parameters(256, 2)
    embedding = 1024 // 2 * 256 + 128 * 256   # word embeddings split over TP, positions whole
    expected = {0: two_layers + embedding, 1: two_layers, 2: two_layers, 3: two_layers + 2 * 256 + embedding}
    for record in records.values():   # the last stage holds DeepSpeed's tied embedding module whole
        assert record["parameters"] == expected[record["coordinates"]["pipe"]], record["rank"]
        assert record["bytes"]["weights"] == 2 * record["parameters"]            # bf16
        assert record["new_groups"] == records["0"]["new_groups"]
    assert f"{expected[3]:>15,} ({expected[3]:>15,})" in result.stdout
    iteration_traffic_worked_by_hand(records, expected)


def _count(record, op, group=None, peer=None, size=None):
    return sum(1 for entry in record["step"]["ops"] if entry["op"] == op and
               (group is None or entry["group"] == group) and (peer is None or entry.get("peer") == peer) and
               (size is None or entry["bytes"] == size))


def iteration_traffic_worked_by_hand(records, parameters):
    """The ramp-up-free first batch: 16 / (1 x DP 2) = 8 micro-batches; one activation [128, 1, 256] in bf16 is
    P = 65,536 bytes, sent between stages as DeepSpeed's 1/TP half (32,768) with its 72-byte layout."""
    p, m = 65536, 8
    middle, first, last = records["5"], records["0"], records["12"]
    assert all(record["step"]["micro_batches"] == m for record in records.values())
    # stage 1, TP rank 1: per micro-batch 2 layers x (2 all-reduces forward + 2 backward) over TP; 3 all-gathers
    # rebuilding the halves (received activation, own output before backward, received gradient)
    assert _count(middle, "allreduce", [4, 5], size=p) == m * 2 * 4
    assert _count(middle, "_allgather_base", [4, 5], size=p) == m * 3
    assert _count(middle, "send", peer=9, size=p // 2) == m and _count(middle, "send", peer=1, size=p // 2) == m
    assert _count(middle, "recv", peer=1, size=p // 2) == m and _count(middle, "recv", peer=9, size=p // 2) == m
    # ZeRO-1 over DP [5, 7]: fp32 gradients all-reduced, bf16 weights all-gathered, in DeepSpeed's buckets
    assert sum(e["bytes"] for e in middle["step"]["ops"] if e["op"] == "allreduce" and e["group"] == [5, 7]) \
        == 4 * parameters[1]
    assert sum(e["bytes"] for e in middle["step"]["ops"] if e["op"] == "_allgather_base" and
               e["group"] == [5, 7]) == 2 * parameters[1]
    # the first stage adds the embedding's all-reduce; the last the head's input gradient and the cross
    # entropy's statistics (max: 128 x 4 bytes; sum of exp and target logit: 2 x 128 x 4)
    assert _count(first, "allreduce", [0, 1], size=p) == m * (2 * 4 + 1)
    assert _count(last, "allreduce", [12, 13], size=p) == m * (2 * 4 + 1)
    assert _count(last, "allreduce", [12, 13], size=512) == m and _count(last, "allreduce", [12, 13], size=1024) == m
    # the tied embedding's gradient (vocab 1024 / 2 x 256, fp32) between the first and the last stage
    assert _count(first, "allreduce", [0, 12], size=512 * 256 * 4) == 1


def test_all_ranks_form_their_groups_and_an_extra_group_on_one_rank_is_named(tmp_path):
    result = dry(WORLD_16 + ["--ranks", "all", "--json", str(tmp_path / "all.json")])
    assert_succeeded(result, tail=None)
    records = json.loads((tmp_path / "all.json").read_text())["ranks"]
    assert len(records) == 16 and len({record["new_groups_digest"] for record in records.values()}) == 1
    assert "with 16 ranks (process groups only)" in result.stdout

    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_EXTRA_GROUP"):
            import torch.distributed as dist
            from megatron_ds.training import initialize as start_up
            initialize = start_up.initialize_groups

            def with_an_extra_group(args):
                initialize(args)
                if dist.get_rank() == 5:
                    dist.new_group(ranks=[5, 6])

            start_up.initialize_groups = with_an_extra_group
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_EXTRA_GROUP": "1"}
    result = dry(WORLD_16 + ["--ranks", "all"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ranks 0 and 5 create different process groups" in result.stderr
    assert "--ranks 0,5 names the first that differs" in result.stderr
    result = dry(WORLD_16 + ["--ranks", "0,5"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    # ours first: 8 tensor, 8 data, 4 pipeline, 16 sequence (one rank each) and 8 sequence-data groups = 44; then
    # DeepSpeed's grid, on rank 0 from the whole world, on rank 5 after the extra one
    assert "ranks 0 and 5 create different process groups: group 44 is [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, " \
           "13, 14, 15] on rank 0 and [5, 6] on rank 5 (71 and 72 groups in all)" in result.stderr, result.stderr


def test_an_moe_world_forms_its_expert_groups_and_steps_as_planned(tmp_path):
    records = stepped_as_planned(tmp_path, MODEL + ["--tensor-model-parallel-size", "2",
                                                    "--pipeline-model-parallel-size", "2", "--num-experts", "4",
                                                    "--moe-expert-parallel-size", "2"])
    # stage 1 holds ranks 4-7; EP 2 runs over consecutive ranks (TP fastest): experts split between 4 and 5
    assert records["5"]["groups"]["ours"]["expert"] == [4, 5]
    assert records["5"]["groups"]["ours"]["expert-data"] == [5, 7]
    moe_iteration_worked_by_hand(records["5"])


def moe_iteration_worked_by_hand(last):
    """Rank 5: stage 1 (layers 5-8; every second layer is MoE: 6 and 8), TP rank 1, 16 / DP 2 = 8 micro-batches.
    P = 128 tokens x 256 x 2 bytes = 65,536. Top-1 with capacity factor 1: C = 128 / 4 experts = 32 slots each;
    each TP rank sends its 16 of every expert's slots: [4, 16, 256] bf16 = 32,768 bytes per all-to-all."""
    m, p = 8, 65536
    # the MoE layers' MLPs have no TP all-reduce: 2 dense layers x 4 + 2 MoE layers x 2 (attention) + the head's
    assert _count(last, "allreduce", [4, 5], size=p) == m * (2 * 4 + 2 * 2 + 1)
    # DeepSpeed's gather of the TP ranks' slots after the combine and in the drop's backward ([4, 32, 256] = P),
    # and the received activation's halves
    assert _count(last, "_allgather_base", [4, 5], size=p) == m * (2 * 2 + 1)
    # dispatch and combine, forward and backward, per MoE layer
    assert _count(last, "alltoall_base", [4, 5], size=32768) == m * 2 * 4
    # 2 MoE layers x 2 local experts x fc1 (256 x 1024 + 1024) and fc2 (1024 x 256 + 256): reduced over the
    # expert-data-parallel group in fp32, apart from the rest
    experts = 2 * 2 * (256 * 1024 + 1024 + 1024 * 256 + 256)
    assert _count(last, "allreduce", [5, 7], size=4 * experts) == 1
    assert _count(last, "allreduce", [5, 7], size=4 * (last["parameters"] - experts)) == 1


def test_a_ulysses_world_steps_as_planned(tmp_path):
    """TP 2 x Ulysses 2 x PP 2 at DP 1, where the sequence-data group is the Ulysses group: its all-to-alls are
    Ulysses traffic, the gradient reduction over the same ranks data traffic."""
    last = stepped_as_planned(tmp_path, MODEL + ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                                                 "--pipeline-model-parallel-size", "2", "--ds-sequence-parallel-size",
                                                 "2"])["5"]
    # rank = pipe x 4 + seq x 2 + tp: rank 5 is stage 1, Ulysses rank 0, TP rank 1
    assert last["groups"]["ours"]["sequence"] == last["groups"]["ours"]["sequence-data"] == [5, 7]
    # 16 / (DP 1 x 2) = 8 micro-batches of 2 x 128 / U 2 tokens: P = 128 x 256 x 2 = 65,536 per rank
    m, p = 8, 65536
    assert _count(last, "allreduce", [4, 5], size=p) == m * (4 * 4 + 1)
    # q, k, v and attention's output forward, their gradients backward, for a / t = 4 heads: P / t each
    assert _count(last, "alltoall_base", [5, 7], size=p // 2) == m * 4 * 8
    traffic = step_checks.recorded_traffic(last)
    assert traffic["ulysses"] == m * 4 * 8 * p // 2 // 2   # each rank keeps half of what it sends itself
    # over two ranks a ring all-reduce sends its payload once, an all-gather half of its output: the fp32
    # gradients' all-reduce (4 bytes a parameter) and the bf16 weights' all-gather (2 bytes, half of it sent),
    # and one fp32 scalar all-reduced
    assert traffic["data"] == 4 * last["parameters"] + 2 * last["parameters"] // 2 + 4


def test_a_context_parallel_world_steps_as_planned(tmp_path):
    """TP 2 x CP 2 x PP 2 at DP 1, attention dropout 0 (the ring's blocks then take the flash kernel, as on a GPU):
    the ring runs on the fake tensors and its sends to the other CP rank are context traffic, as planned."""
    last = stepped_as_planned(tmp_path, MODEL + ["--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                                                 "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
                                                 "--attention-dropout", "0"])["5"]
    # rank = pipe x 4 + cp x 2 + tp: rank 5 is stage 1, CP rank 0, TP rank 1; its ring's other rank is 7
    assert last["groups"]["ours"]["context"] == last["groups"]["ours"]["sequence-data"] == [5, 7]
    # 8 micro-batches x 4 layers; a key/value block is 2 samples x 64 tokens x 4 heads x (32 + 32) x 2 bytes:
    # forward 1 hop, backward 1 hop and the fp32 dK and dV 2 hops, each K and V (or dK and dV) a send of their own
    m, layers, half_block = 8, 4, 2 * 64 * 4 * 32 * 2
    assert _count(last, "send", peer=7, size=half_block) == m * layers * 2 * 2
    assert _count(last, "send", peer=7, size=2 * half_block) == m * layers * 2 * 2
    assert step_checks.recorded_traffic(last)["context"] == m * layers * (2 * 2 * half_block + 2 * 4 * half_block)


def test_an_extra_all_reduce_on_one_rank_is_named_as_the_deadlock_it_would_be(tmp_path):
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_EXTRA_ALL_REDUCE"):
            import torch
            import torch.distributed as dist
            from megatron_ds.core import parallel_state
            from megatron_ds.training import loop
            run = loop.run_global_batch

            def with_an_extra_all_reduce(engine, *args, **kwargs):
                if dist.get_rank() == 5:
                    dist.all_reduce(torch.zeros(3), group=parallel_state.get_tensor_model_parallel_group())
                return run(engine, *args, **kwargs)

            loop.run_global_batch = with_an_extra_all_reduce
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_EXTRA_ALL_REDUCE": "1"}
    result = dry(WORLD_16 + ["--step", "--ranks", "4,5"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    # rank 4's first TP collective of the iteration rebuilds the received activation from its TP halves
    assert "group [4, 5]: collective 1 is _allgather_base of 65,536 bytes on rank 4 and allreduce of 12 bytes on " \
           "rank 5 (88 and 89 collectives on it in all)" in result.stderr, result.stderr


def test_a_rank_whose_start_up_fails_is_named_with_its_error_and_the_next_rank_still_runs(tmp_path):
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_FAILING_RANK"):
            from megatron_ds.training import initialize
            start_up = initialize.start_up

            def failing_on_rank_4(args, **kwargs):
                if os.environ["RANK"] == "4":
                    raise RuntimeError("injected start-up failure")
                return start_up(args, **kwargs)

            initialize.start_up = failing_on_rank_4
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_FAILING_RANK": "1"}
    result = dry(WORLD_16 + ["--ranks", "4,5", "--jobs", "1"], environment)   # one worker runs 4, then 5
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 4 failed its start-up:" in result.stderr
    assert "RuntimeError: injected start-up failure" in result.stderr
    assert "rank 5 failed" not in result.stderr
    assert "covered 1 of 8 (pipeline stage, TP position) classes with 1 ranks" in result.stdout


def test_a_worker_that_dies_fails_the_rank_it_held_and_a_new_worker_takes_the_next(tmp_path):
    """--ranks all checks the process groups of many ranks in each worker process, without a child per rank: an
    error there ends the worker. One worker (--jobs 1) over a world of 4: it dies in rank 1's groups, rank 1 is
    named with its error, and a new worker runs ranks 2 and 3."""
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_DYING_WORKER"):
            from megatron_ds.training import initialize
            initialize_groups = initialize.initialize_groups

            def failing_on_rank_1(args):
                if os.environ["RANK"] == "1":
                    raise RuntimeError("injected error in the groups of rank 1")
                return initialize_groups(args)

            initialize.initialize_groups = failing_on_rank_1
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_DYING_WORKER": "1"}
    world = MODEL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--world-size", "4"]
    result = dry(world + ["--ranks", "all", "--jobs", "1"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    failures = re.findall(r"rank (\d+) failed its start-up:", result.stderr)
    assert failures == ["1"], result.stderr
    assert "RuntimeError: injected error in the groups of rank 1" in result.stderr
    assert "covered 3 of 4 (pipeline stage, TP position) classes with 3 ranks (process groups only)" in result.stdout


def test_memory_held_beyond_the_plan_on_one_rank_is_named(tmp_path):
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_EXTRA_MEMORY"):
            import torch
            import torch.distributed as dist
            from megatron_ds.training import loop
            run, kept = loop.run_global_batch, []

            def keeping_4_mib_more(engine, *args, **kwargs):
                if dist.get_rank() == 5:
                    kept.append(torch.empty(1 << 20))
                return run(engine, *args, **kwargs)

            loop.run_global_batch = keeping_4_mib_more
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_EXTRA_MEMORY": "1"}
    result = dry(WORLD_16 + ["--step", "--ranks", "4,5"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line.strip() for line in result.stderr.split("dry run FAILED:")[1].strip().splitlines()]
    assert len(problems) == 1 and problems[0].startswith("- rank 5 (stage 1) holds "), result.stderr
    held, planned = (float(word.replace(",", "")) for word in re.findall(r"([\d,.]+) MiB", problems[0]))
    assert 4.0 < held - planned < 4.0 + 0.05 * planned   # the 4 MiB kept, on what the check lets pass
    assert f"({held / planned:.3f}x)" in problems[0]


def test_a_micro_batch_that_overflows_one_stage_names_that_rank_and_the_device():
    """s 2048 x b 480 at h 256, TP 2: a layer keeps s b h (10 + 24/2 + (4a/h)/2) = 22.06 s b h bytes per
    micro-batch (flash attention), 5.6 GB; stage 0 of 4 holds 4 micro-batches of 2 layers (45 GiB with the
    backward working set and the pipeline's buffers), over an A100-40GB's 40 GiB with the 2 GiB runtime overhead;
    stage 1 holds 3 (34 GiB) and fits. Both peaks within 1% of the planner's."""
    flags = list(WORLD_16)
    for flag, value in (("--seq-length", "2048"), ("--micro-batch-size", "480"), ("--global-batch-size", "7680")):
        flags[flags.index(flag) + 1] = value   # still 8 micro-batches
    flags += ["--max-position-embeddings", "2048"]
    result = dry(flags + ["--step", "--ranks", "0,4", "--device", "a100-40gb", "--start-anyway"])
    assert result.returncode == 1, result.stdout + result.stderr
    problems = [line.strip() for line in result.stderr.split("dry run FAILED:")[1].strip().splitlines()]
    assert len(problems) == 1, result.stderr
    assert problems[0].startswith("- rank 0 (stage 0) holds 4") and "more than the NVIDIA A100-SXM4-40GB's 40 " \
        "GiB" in problems[0], problems[0]


def test_a_launch_the_planner_puts_over_memory_is_answered_before_any_rank_starts():
    """The same launch without --start-anyway: the planner's figures alone answer it (stage 0 over, stage 1 not
    named), and no rank's start-up runs."""
    flags = list(WORLD_16)
    for flag, value in (("--seq-length", "2048"), ("--micro-batch-size", "480"), ("--global-batch-size", "7680")):
        flags[flags.index(flag) + 1] = value
    result = dry(flags + ["--max-position-embeddings", "2048", "--step", "--ranks", "0,4", "--device", "a100-40gb"])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "dry run FAILED before any rank started" in result.stderr and "dry run:" not in result.stdout, \
        result.stdout + result.stderr
    stages = re.findall(r"stage (\d+): ([\d,.]+) GiB", result.stderr)
    assert [stage for stage, _ in stages] == ["0"] and float(stages[0][1].replace(",", "")) > 40, result.stderr
    assert "NVIDIA A100-SXM4-40GB's 40 GiB" in result.stderr


def test_a_partition_that_leaves_a_stage_without_layers_is_named(tmp_path):
    """Stage boundaries that put all 8 layers in the first two stages (the specs: embedding, 8 layers, final norm,
    tied head; cut at 0, 5, 9, 10, 11) leave stage 2 the final norm alone, which the dry run names."""
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_PARTITION"):
            from megatron_ds.training import model_setup
            choose = model_setup.pipeline_module_class

            def cut_after_two_stages(name, virtual_stages=1, stage_boundaries=None):
                return choose(name, virtual_stages, [0, 5, 9, 10, 11])

            model_setup.pipeline_module_class = cut_after_two_stages
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_PARTITION": "1"}
    result = dry(WORLD_16 + ["--ranks", "8", "--jobs", "1"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 8 (stage 2): no transformer layer: a pipeline stage without layers, the planner 2" in result.stderr
    assert "rank 8 (stage 2): 512 parameters, the planner 791,296" in result.stderr   # the final norm only


def test_a_tie_group_the_last_stage_does_not_join_is_named(tmp_path):
    """The last stage built untied (a model change on one rank) never joins the embedding's tie group [0, 12]:
    rank 0's tied gradient all-reduce would wait for it forever."""
    hook = sitecustomize(tmp_path, """
        import os
        if os.environ.get("DRY_RUN_TEST_TIE"):
            from megatron_ds.training import model_setup
            specs = model_setup.gpt_layer_specs

            def untied_on_rank_12(config, vocab_size, max_sequence_length, *args, **kwargs):
                if os.environ["RANK"] != "12":   # set per rank, after this file runs
                    return specs(config, vocab_size, max_sequence_length, *args, **kwargs)
                return specs(config, vocab_size, max_sequence_length, share_embeddings_and_output_weights=False)

            model_setup.gpt_layer_specs = untied_on_rank_12
    """)
    environment = {"PYTHONPATH": str(hook), "DRY_RUN_TEST_TIE": "1"}
    result = dry(WORLD_16 + ["--step", "--ranks", "0,12"], environment)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ranks 0 and 12 create different process groups: group 67 is [0, 12] on rank 0 and (none) on rank 12" \
        in result.stderr
    assert "group [0, 12]: rank 0 issues 1 collectives on it, rank 12 0; the first unmatched is rank 0's allreduce " \
        "of 524,288 bytes" in result.stderr


FP8_WORLD = ["--fp8-format", "e4m3", "--tensor-model-parallel-size", "2", "--sequence-parallel",
             "--pipeline-model-parallel-size", "2"]


def test_an_fp8_world_steps_as_planned(tmp_path):
    """FP8 (tensorwise E4M3) at TP 2 + SP x PP 2 x DP 2 on H100s: torch._scaled_mm runs on the fake tensors, the
    traffic (the amax all-reduces, and no all-gathers again of QKV's and fc1's saved shards) and each rank's peak
    (the FP8 copies in place of the 16-bit inputs) as the planner's. Rank 0, stage 0: 4 FP8 layers x 8
    micro-batches x 8 amax all-reduces (6 forward, 2 backward) of 4 bytes over its TP group."""
    rank_0 = stepped_as_planned(tmp_path, MODEL + FP8_WORLD + ["--fp8-recipe", "tensorwise", "--device",
                                                               "h100-80gb"])["0"]
    assert _count(rank_0, "allreduce", group=[0, 1], size=4) >= 4 * 8 * 8


def test_delayed_fp8_reduces_its_amaxes_once_per_step_over_the_stage(tmp_path):
    """Delayed scaling (E4M3, the default recipe) in the same world: no amax all-reduce per GEMM; after the step, one
    all-reduce over TP and one over DP of stage 0's 4 layers x 4 linears x 3 amaxes (input, weight, gradient) x 4
    bytes = 192."""
    rank_0 = stepped_as_planned(tmp_path, MODEL + FP8_WORLD + ["--device", "h100-80gb"])["0"]
    assert _count(rank_0, "allreduce", group=[0, 1], size=4) == 0
    assert _count(rank_0, "allreduce", group=[0, 1], size=192) == 1
    assert _count(rank_0, "allreduce", group=[0, 2], size=192) == 1


def test_fp8_on_a_device_without_it_is_refused_before_any_rank_starts():
    result = dry(MODEL + FP8_WORLD + ["--world-size", "8", "--device", "a100-80gb"])
    assert result.returncode == 2, result.stderr
    assert "--fp8-format e4m3 cannot run on --device: NVIDIA A100-SXM4-80GB has no FP8 tensor cores" in result.stderr
