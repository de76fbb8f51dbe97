"""Multi-token prediction on one batch against an independent computation: the tokens ahead and the shifted
targets written out position by position, the norms, the projection and the shared head in plain torch (only the
MTP module's transformer layer is the library's, run on the input computed here). The value the loss returns is the
main loss, bitwise; its gradient carries the weighted MTP loss. One real gloo rank."""
import pytest
import torch
import torch.nn.functional as F

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer.multi_token_prediction import scheduled_factor, tokens_ahead
from megatron_ds.core.transformer.transformer_config import TransformerConfig
from tests.support.distributed import run_distributed

VOCAB, SEQ, BATCH, HIDDEN = 64, 10, 2, 16


def _model(depths, untied=False):
    from megatron_ds.core.models.gpt import GPTModel
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, hidden_dropout=0.0,
                               attention_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
                               ffn_hidden_size=32, bias=False, position_embedding_type="rope", mtp_num_layers=depths)
    return GPTModel(config, VOCAB, SEQ, share_embeddings_and_output_weights=not untied).double()


def _rms_norm(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight


def _batch():
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    loss_mask = (torch.rand(BATCH, SEQ, generator=generator) > 0.2).double()
    return tokens[:, :-1], tokens[:, 1:], loss_mask


def _reference_mtp_loss(model, input_ids, labels, loss_mask, with_gradient=False):
    """The mean over depths k of the masked cross entropy of depth k's logits against the token k + 1 ahead."""
    word = model.embedding.word_embeddings.weight
    head = word if model.output_layer is None else model.output_layer.linear.weight
    with torch.set_grad_enabled(with_gradient):
        hidden = word[input_ids].transpose(0, 1)
        for layer in model.layers:
            hidden = layer(hidden)
        hidden = _rms_norm(hidden, model.final_layernorm.norm)
        losses = []
        for k, module in enumerate(model.mtp.layers, start=1):
            ahead = torch.zeros_like(input_ids)  # token i + k at position i, 0 past the end
            targets = torch.zeros_like(labels)  # token i + k + 1: labels k places ahead
            mask = torch.zeros_like(loss_mask)
            for i in range(SEQ - k):
                ahead[:, i], targets[:, i], mask[:, i] = input_ids[:, i + k], labels[:, i + k], loss_mask[:, i + k]
            embedded = word[ahead].transpose(0, 1)
            combined = torch.cat((_rms_norm(embedded, module.enorm), _rms_norm(hidden, module.hnorm)), dim=-1)
            hidden = _rms_norm(module.mtp_model_layer(combined @ module.eh_proj.weight.t()), module.final_layernorm)
            logits = (hidden @ head.t()).transpose(0, 1)
            per_token = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
            losses.append((per_token * mask.reshape(-1)).sum() / mask.sum())
        return torch.stack(losses).mean()


def _mtp_loss_matches_the_reference(depths, untied):
    model = _model(depths, untied)
    input_ids, labels, loss_mask = _batch()
    loss = model(input_ids, labels=(labels, loss_mask))
    recorded = model.loss_fn.micro_batch_losses[-1]
    expected = _reference_mtp_loss(model, input_ids, labels, loss_mask)
    torch.testing.assert_close(recorded.double(), expected, rtol=1e-6, atol=0)  # the loss sums in fp32
    main = model.loss_fn.loss_fn(model(input_ids), (labels, loss_mask))  # the logits alone: no MTP run
    assert loss.item() == main.item()  # bitwise: the lm loss logged is the main model's


@pytest.mark.parametrize("depths,untied", [(1, False), (2, True)])
def test_the_mtp_loss_equals_the_shifted_targets_written_out(depths, untied):
    run_distributed(_mtp_loss_matches_the_reference, 1, depths, untied)


def _gradient_carries_the_weighted_mtp_loss():
    model = _model(1)
    input_ids, labels, loss_mask = _batch()
    model.loss_fn.factor = 0.3
    model(input_ids, labels=(labels, loss_mask)).backward()
    eh_proj = model.mtp.layers[0].eh_proj.weight
    got = eh_proj.grad.clone()
    model.zero_grad()
    (0.3 * _reference_mtp_loss(model, input_ids, labels, loss_mask, with_gradient=True)).backward()
    assert got.abs().sum() > 0
    torch.testing.assert_close(got, eh_proj.grad, rtol=1e-4, atol=1e-8)  # the loss takes its mask in fp32


def test_the_gradient_carries_the_weighted_mtp_loss():
    """The eh_proj's gradient (reached by the MTP loss only) is factor x that of the MTP loss."""
    run_distributed(_gradient_carries_the_weighted_mtp_loss, 1)


def _tokens_ahead_of_a_row():
    parallel_state.initialize_model_parallel(1, 1)
    assert tokens_ahead(torch.arange(1, 7).view(1, 6), 2).tolist() == [[3, 4, 5, 6, 0, 0]]


def test_tokens_ahead_and_the_weight_schedule():
    run_distributed(_tokens_ahead_of_a_row, 1)
    steps = ((10_000_000_000_000, 0.1),)
    assert [scheduled_factor(0.3, steps, t) for t in (0, 9_999_999_999_999, 10_000_000_000_000)] == [0.3, 0.3, 0.1]
