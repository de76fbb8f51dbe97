"""fp16's dynamic loss scale across a resharded load: read from the saved ZeRO files as DeepSpeed's own
same-layout load reads it (the file written here as DeepSpeed writes it, so the test runs where DeepSpeed has no
fp16)."""
import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

from megatron_ds.checkpointing.state import read_loss_scaler


def _metadata(precision, zero_stage=1):
    return {"format": "deepspeed", "layout": {"precision": precision, "zero_stage": zero_stage}}


def test_the_saved_dynamic_loss_scale_is_read_for_an_fp16_zero_checkpoint(tmp_path):
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=100, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    scaler.cur_scale, scaler.cur_iter = 512.0, 37
    torch.save({"optimizer_state_dict": {"loss_scaler": scaler, "dynamic_loss_scale": True}},
               tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    saved = read_loss_scaler(str(tmp_path), _metadata("float16"))
    assert saved["dynamic_loss_scale"] is True
    assert (saved["loss_scaler"].cur_scale, saved["loss_scaler"].cur_iter) == (512.0, 37)


def test_nothing_is_read_for_other_precisions_or_without_zero(tmp_path):
    assert read_loss_scaler(str(tmp_path), _metadata("float32")) == {}
    assert read_loss_scaler(str(tmp_path), _metadata("bfloat16")) == {}
    assert read_loss_scaler(str(tmp_path), _metadata("float16", zero_stage=0)) == {}
