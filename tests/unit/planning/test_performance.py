"""megatron_ds.planning.performance: the 1F1B bubble (p - 1) / (m + p - 1) (docs/formulas.md) and the
no-overlap time model of the module docstring, worked through by hand."""
import pytest

from megatron_ds.planning import communication as comm
from megatron_ds.planning.hardware_flops import model_flops_per_iteration
from megatron_ds.planning.model import Layout
from megatron_ds.planning.parameters import stage_parameters
from megatron_ds.planning.performance import PerformanceAssumptions, estimate_performance, stage_time
from megatron_ds.planning.pipeline import bubble_fraction
from tests.support.planning_specs import cpu_cluster, hand_case, time_case

# distinct efficiencies, so a term divided by the wrong one shows
ASSUMPTIONS = PerformanceAssumptions(compute_efficiency=0.5, bandwidth_efficiency=0.25)
FLOPS = 2e12 * 0.5          # the cpu entry's 2 TFLOP/s at 50%
LINK = 20e9 * 0.25          # its 20 GB/s within a node at 25%: every group of the hand case fits in one node
HBM = 100e9 * 0.25          # its 100 GB/s memory at 25%


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(35, 240) == pytest.approx(34 / 274)
    assert bubble_fraction(8, 1) == pytest.approx(7 / 8)          # one micro-batch: the pipeline runs serially
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)


def test_time_structure():
    model, layout = time_case()
    performance = estimate_performance(model, layout, cpu_cluster(), stage_parameters(model, 1, 4),
                                       PerformanceAssumptions())
    assert performance["bubble_fraction"] == pytest.approx(3 / (4 + 3))          # DP 2 -> 4 micro-batches
    parts = performance["breakdown_s"]
    assert parts["pipeline"] == pytest.approx(7 * performance["slowest_stage"]["total"])
    assert parts["of_which_bubble"] == pytest.approx(3 * performance["slowest_stage"]["total"])
    assert performance["iteration_s"] == pytest.approx(parts["pipeline"] + parts["data_parallel"] +
                                                       parts["tied_embedding"] + parts["optimizer_step"])
    assert performance["mfu"] == pytest.approx(model_flops_per_iteration(model, layout) /
                                               performance["iteration_s"] / 8 / 2e12)


def test_stage_times_by_hand():
    """Per micro-batch on the hand case's stages (60608 and 60736 parameters per device): FLOPs from
    tests/unit/planning/test_flops.py; TP 2 layers x 4 x 8192 bytes, plus the all-gathers of DeepSpeed's messages split
    over TP (1/2 x 8192 each): stage 0 its output before the backward and the received gradient, stage 1 the
    received activation; stage 0's embedding all-reduce (8192), stage 1's head-input gradient all-reduce (8192)
    and cross-entropy statistics (3 x 64 tokens x 4 bytes); PP one message each way of the 8192-byte payload, 1/2
    of it per TP rank; and BF16_Optimizer's accumulation reading 2 + 4 and writing 4 bytes per parameter."""
    model, layout = hand_case()
    cluster = cpu_cluster()
    links = comm.links(layout, cluster)
    first, last = (stage_time(model, layout, cluster, ASSUMPTIONS, stage, links)
                   for stage in stage_parameters(model, 2, 2))
    assert first.compute == pytest.approx(20_447_232 / FLOPS)
    assert last.compute == pytest.approx(23_592_960 / FLOPS)                      # + the head
    assert first.tensor_parallel == pytest.approx((65536 + 2 * 4096 + 8192) / LINK)
    assert last.tensor_parallel == pytest.approx((65536 + 4096 + 8192 + 768) / LINK)
    assert first.pipeline_p2p == last.pipeline_p2p == pytest.approx(4096 / LINK)
    assert first.grad_accumulation == pytest.approx(10 * 60608 / HBM)
    assert last.grad_accumulation == pytest.approx(10 * 60736 / HBM)
    assert last.total == pytest.approx(64.42496e-6)


def test_iteration_time_by_hand():
    """(m + p - 1) = 5 slots of the last stage's 64.42496 us, then DP (fp32 gradient all-reduce 2 x 1/2 x 4
    + bf16 weight all-gather 1/2 x 2 bytes per parameter), the tied embedding all-reduce (8192 x 4 bytes)
    and the optimizer step over the ZeRO-1 shard (60736 / 2 parameters x (4 + 2 x 12 + 2) bytes)."""
    model, layout = hand_case()
    performance = estimate_performance(model, layout, cpu_cluster(), stage_parameters(model, 2, 2), ASSUMPTIONS)
    parts = performance["breakdown_s"]
    assert performance["slowest_stage"]["stage"] == 1
    assert parts["pipeline"] == pytest.approx(5 * 64.42496e-6)
    assert parts["of_which_bubble"] == pytest.approx(64.42496e-6)                # 1/5 of it
    assert parts["data_parallel"] == pytest.approx((60736 * 4 + 60736 * 2 / 2) / LINK)
    assert parts["tied_embedding"] == pytest.approx(8192 * 4 / LINK)
    assert parts["optimizer_step"] == pytest.approx(60736 / 2 * 30 / HBM)
    iteration = 322.1248e-6 + 60.736e-6 + 6.5536e-6 + 36.4416e-6
    assert performance["iteration_s"] == pytest.approx(iteration) == 425.856e-6
    assert performance["tokens_per_second"] == pytest.approx(16 * 32 / iteration)
    assert performance["mfu"] == pytest.approx(704_643_072 / iteration / 8 / 2e12)
    assert performance["hardware_tflops_per_device"] == pytest.approx(704_643_072 / iteration / 8 / 1e12)


def test_fp32_optimizer_step_writes_no_16_bit_copy():
    """The time case's last stage: 2 layers x 49984 + final norm 128 + the tied embedding's copy
    (51200 + 32) x 64 = 3378944 parameters; ZeRO-1 over DP 2; 4 + 2 x 12 bytes per parameter of the shard."""
    model, layout = time_case()
    performance = estimate_performance(model, layout, cpu_cluster(), stage_parameters(model, 1, 4),
                                       PerformanceAssumptions())
    assert performance["breakdown_s"]["optimizer_step"] == pytest.approx(3378944 / 2 * 28 / (100e9 * 0.7))


def test_no_data_parallel_time_without_dp():
    model, _ = hand_case()
    layout = Layout(2, 2, 1, 2, 8)
    performance = estimate_performance(model, layout, cpu_cluster(4), stage_parameters(model, 2, 2), ASSUMPTIONS)
    assert performance["breakdown_s"]["data_parallel"] == 0
    assert performance["breakdown_s"]["optimizer_step"] == pytest.approx(60736 * 30 / HBM)   # unsharded


def test_assumptions_describe_the_efficiencies_used():
    text = " ".join(PerformanceAssumptions(0.55, 0.8).describe())
    assert "55%" in text and "80%" in text and "(m + p - 1)" in text
