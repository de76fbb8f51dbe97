"""The dry run's iteration recorder (dry_run/fake_step.py) on a small fake computation: the bytes it follows."""
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from megatron_ds.planning.dry_run.fake_step import StepRecorder

ROWS_BYTES = 8 * 64 * 4      # one [8, 64] fp32 activation
WEIGHT_BYTES = 64 * 64 * 4


def test_an_activation_saved_for_backward_counts_until_backward_frees_it():
    with FakeTensorMode() as mode:
        weight = torch.randn(64, 64, requires_grad=True)
        inputs = torch.randn(8, 64)
    recorder = StepRecorder({}, mode)
    with recorder:
        loss = torch.tanh(inputs @ weight).sum()   # the matmul's output dies; tanh saves its own for backward
        after_forward = recorder.live_bytes
        loss.backward()
        del loss
    assert after_forward == ROWS_BYTES + 4                    # tanh's output and the loss
    assert recorder.live_bytes == WEIGHT_BYTES                # the weight's gradient stays
    # matmul and tanh outputs together; later tanh's output, the loss, its gradient and tanh's input gradient
    assert recorder.transient_peak_bytes() == 2 * ROWS_BYTES + 8
    assert recorder.peak_bytes == WEIGHT_BYTES + ROWS_BYTES + 8


def test_a_tensor_made_from_nothing_is_fake_unless_it_holds_integers():
    with FakeTensorMode() as mode:
        pass
    with StepRecorder({}, mode):
        mask = torch.empty(1024, 1024, dtype=torch.bool).bernoulli_(0.9)
        shape_message = torch.zeros(4, dtype=torch.long)
    assert isinstance(mask, FakeTensor)
    assert not isinstance(shape_message, FakeTensor) and shape_message.tolist() == [0, 0, 0, 0]


def test_an_arange_of_integers_is_real_and_one_of_floats_fake():
    """The dropless MoE layer orders its received rows with aranges of integers (torch's int64) on the counts."""
    with FakeTensorMode() as mode:
        pass
    with StepRecorder({}, mode):
        positions = torch.arange(6)
        steps = torch.arange(0.0, 1.0, 0.25)
    assert not isinstance(positions, FakeTensor) and positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert isinstance(steps, FakeTensor) and steps.dtype == torch.float32
