"""megatron_ds.planning.planner: one layout's plan, its sections worked out by hand for the hand case
(tests/support/planning_specs.py), its errors and warnings."""
import dataclasses

from megatron_ds.planning.memory import GIB
from megatron_ds.planning.model import Layout
from megatron_ds.planning.parameters import stage_parameters
from megatron_ds.planning.planner import make_plan, representative_stages
from tests.support.planning_specs import cpu_cluster, hand_case, small_model


def hand_plan(**changes):
    model, layout = hand_case()
    return make_plan(model, dataclasses.replace(layout, **changes), cpu_cluster())


def test_representative_stages_are_the_first_two_and_the_last():
    stages = stage_parameters(small_model(layers=6), 1, 6)
    assert [stage.stage for stage in representative_stages(stages)] == [0, 1, 5]
    assert [stage.stage for stage in representative_stages(stages[:2])] == [0, 1]
    assert [stage.stage for stage in representative_stages(stages[:1])] == [0]


def test_parameters_section_by_hand():
    """A whole layer is 12h^2 + 13h = 49984; a stage's total counts every TP rank's share once."""
    parameters = hand_plan()["parameters"]
    assert parameters["total"] == 256 * 64 + 32 * 64 + 4 * 49984 + 2 * 64 == 218496
    assert parameters["padded_vocab_size"] == 256
    first, last = parameters["per_stage"]
    assert (first["stage_total"], first["per_device"]) == (256 * 64 + 32 * 64 + 2 * 49984, 60608)
    assert (last["stage_total"], last["per_device"]) == (2 * 49984 + 2 * 64 + 256 * 64 + 32 * 64, 60736)
    assert last["per_device_parts"] == {"embedding": 0, "layers": 2 * 25184, "final_norm": 128,
                                        "output_head": 128 * 64 + 32 * 64}
    assert parameters["per_device_max"] == 60736


def test_memory_section_by_hand():
    memory = hand_plan()["memory"]
    first, last = memory["per_stage"]
    assert first["total"] == 14 * 60608 + first["activations"] + 2 * GIB     # tests/unit/planning/test_memory.py
    assert memory["peak_stage"] == 0
    assert memory["margin_bytes"] == 64 * GIB - first["total"]
    assert memory["fits"] and memory["capacity_bytes"] == 64 * GIB
    assert memory["state_bytes_per_parameter_on_device"] == {"weights": 2, "gradients": 2, "grad_accumulation": 4,
                                                            "optimizer": 6}       # 12 / DP 2
    # no recompute: s b h (10 + 24/2 + (4a/h)/2) with flash attention (sdpa, the default) = 4096 x 22.125
    assert memory["activation_bytes_per_layer"] == {"None": 90624, "selective": 32 * 2 * 64 * 22,
                                                    "full": 2 * 32 * 2 * 64}


def test_communication_by_hand():
    comm = hand_plan()["communication"]
    payload = 32 * 2 * 64 * 2
    tp = comm["tensor_parallel"]["per_layer_per_micro_batch"]
    assert (tp["forward"], tp["backward"], tp["recompute"]) == (2 * payload, 2 * payload, 0)   # 2 x 2(t-1)/t
    assert comm["tensor_parallel"]["per_iteration_per_device"] == 4 * payload * 2 * 4           # 2 layers, m 4
    # PP 2: each rank sends one message per micro-batch (an activation, or a gradient), split over TP 2; the
    # first rank all-gathers two of them over TP (its output before the backward, the gradient), m 4
    assert comm["pipeline"]["split_over_tensor_parallel"]
    assert comm["pipeline"]["per_iteration_per_device"] == payload / 2 * 4
    assert comm["pipeline"]["tensor_parallel_gathers_per_iteration_per_device"] == 2 * payload / 2 * 4
    dp = comm["data_parallel"]["per_iteration_per_device"]
    assert dp["gradient_all_reduce"] == 60736 * 4 * 2 * (2 - 1) / 2       # fp32 (BF16_Optimizer) all-reduce
    assert dp["weight_all_gather"] == 60736 * 2 * (2 - 1) / 2
    assert comm["data_parallel"]["tied_embedding_all_reduce"] == 128 * 64 * 4


def test_one_stage_and_one_replica_send_nothing_between_them():
    model, _ = hand_case()
    comm = make_plan(model, Layout(2, 1, 1, 2, 8), cpu_cluster(2))["communication"]
    assert comm["pipeline"]["per_iteration_per_device"] == 0
    assert comm["data_parallel"] == {"ranks": 1, "per_iteration_per_device": {}, "tied_embedding_all_reduce": 0}


def test_flops_section_lists_every_recompute_choice():
    flops = hand_plan(recompute="full")["flops"]
    assert flops["hardware_per_iteration"] == flops["hardware_per_iteration_by_recompute"]["full"]
    assert set(flops["hardware_per_iteration_by_recompute"]) == {"None", "selective", "full"}
    assert flops["hardware_per_iteration_by_recompute"]["None"] == flops["model_per_iteration"]


def test_plan_of_a_layout_for_another_world_size_is_an_error():
    model, layout = hand_case()
    plan = make_plan(model, layout, cpu_cluster(16))
    assert plan["errors"] == [["layout does not match the world size", "TP 2 x PP 2 x DP 2 != 16"]]
    assert set(plan) == {"layout", "errors"}


def test_plan_reports_every_broken_rule():
    model, _ = hand_case()
    plan = make_plan(model, Layout(8, 1, 1, 1, 1), cpu_cluster())    # 4 heads over TP 8
    assert [reason for reason, _ in plan["errors"]] == ["heads not divisible by TP", "kv heads not divisible by TP"]


def test_representative_plan_keeps_three_stages_of_many():
    model, _ = hand_case()
    plan = make_plan(model, Layout(1, 4, 2, 1, 8), cpu_cluster(), all_stages=False)
    assert [row["stage"] for row in plan["parameters"]["per_stage"]] == [0, 1, 3]
    assert len(make_plan(model, Layout(1, 4, 2, 1, 8), cpu_cluster())["memory"]["per_stage"]) == 4


def test_warnings():
    model, _ = hand_case()
    assert hand_plan(recompute="selective")["warnings"] == []
    few = make_plan(model, Layout(1, 4, 1, 1, 2, recompute="selective"), cpu_cluster(4))["warnings"]
    assert few == ["2 micro-batches for 4 pipeline stages: most of the iteration is pipeline bubble"]
    sp = make_plan(model, Layout(1, 1, 1, 1, 1, sequence_parallel=True, recompute="selective"), cpu_cluster(1))
    assert sp["warnings"] == ["--sequence-parallel has no effect with TP 1"]
    assert hand_plan()["warnings"] == []          # sdpa without recompute: flash attention's term, no upper bound
    spans = make_plan(model, Layout(4, 1, 1, 1, 1, recompute="selective"), cpu_cluster(4, gpus_per_node=2))
    assert spans["warnings"] == ["TP 4 spans nodes of 2 GPUs: tensor-parallel collectives run over the "
                                 "inter-node network (1.25 GB/s)"]
