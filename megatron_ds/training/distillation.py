"""Knowledge distillation (--kd, Megatron-DeepSpeed's flags): a frozen teacher read from a checkpoint runs beside
the student and the loss adds the temperature-scaled KL divergence of the student's logits from the teacher's.

The teacher is split as the student is: each TP rank holds its TP share (read resharded from the teacher's
checkpoint at whatever layout it was saved), each pipeline stage the teacher layers that ride on its student
layers (core/parallel_layout.teacher_layers_on: a stage runs its share of both in proportion).
Between stages the teacher's hidden states travel beside the student's in the same activation tuple, as an
integer view of their bits: DeepSpeed's pipeline engine sends a gradient back for every floating-point tensor
it sends forward and none for an integer one, so the frozen teacher costs no backward traffic.

The teacher is not a submodule of the model: DeepSpeed's engine, the optimizer and the checkpoints never see it.
"""
import torch
import torch.distributed as dist

from megatron_ds.arguments import transformer_config_from_args
from megatron_ds.checkpointing import discovery, files, layout
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.manager import checkpoint_description
from megatron_ds.checkpointing.state import read_resharded_rank_state
from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt.gpt_model import (
    EmbeddingPipe,
    FinalLayerNorm,
    LanguageModelEmbedding,
    OutputLayer,
    TransformerLayerPipe,
    pack_model_inputs,
    tied_output_logits,
)
from megatron_ds.core.parallel_layout import student_layer_carrying, teacher_layers_on
from megatron_ds.core.tensor_parallel.kl_divergence import vocab_parallel_kl_divergence
from megatron_ds.core.transformer.transformer_layer import TransformerLayer
from megatron_ds.inference.generation import inference_args

_CARRIER_DTYPES = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}

# the student run's values the teacher takes (how to compute); its shape comes from its checkpoint
_RUN_VALUES = ("params_dtype", "sequence_parallel", "fusion_backend", "attention_backend", "no_masked_softmax_fusion",
               "no_persist_layer_norm", "no_rope_fusion", "no_bias_gelu_fusion", "no_bias_swiglu_fusion",
               "no_bias_dropout_fusion", "no_cross_entropy_fusion")

_SHAPE_FLAGS = (("--num-layers-teacher", "num_layers_teacher", "num_layers"),
                ("--hidden-size-teacher", "hidden_size_teacher", "hidden_size"),
                ("--num-attention-heads-teacher", "num_attention_heads_teacher", "num_attention_heads"))


class Teacher(torch.nn.Module):
    """This rank's share of the frozen teacher: its TP share of the layers that ride on this rank's student layers,
    of the embedding where the student's is, and of the final norm and head where the student's are (the embedding
    there too with tied embeddings). Parameters are named as GPTModel's, so checkpoints' canonical names read into
    it."""

    def __init__(self, config, vocab_size, max_positions, tied, rides_on, embedding, head):
        """rides_on: {student layer: the teacher layers run beside it}, this rank's."""
        super().__init__()
        self.config, self.rides_on = config, rides_on
        self.embedding = (LanguageModelEmbedding(config, vocab_size, max_positions)
                          if embedding or (head and tied) else None)
        self.layers = torch.nn.ModuleDict({str(n - 1): TransformerLayer(config, n) for n in self.layer_numbers})
        self.final_layernorm = FinalLayerNorm(config) if head else None
        self.output_layer = OutputLayer(config, vocab_size) if head and not tied else None
        self.requires_grad_(False)
        self.eval()

    @property
    def layer_numbers(self):
        return [number for numbers in self.rides_on.values() for number in numbers]

    def train(self, mode=True):
        return super().train(False)  # frozen: no dropout, whatever the student does

    # --- the pipeline's carrier: the teacher's hidden states as integers of the same width ---
    def carried(self, hidden_states):
        return hidden_states.view(_CARRIER_DTYPES[self.config.params_dtype])

    def unpacked(self, carrier):
        return carrier.view(self.config.params_dtype)

    @torch.no_grad()
    def embed(self, model_inputs):
        input_ids, position_ids = (model_inputs[0], model_inputs[1]) if isinstance(model_inputs, tuple) \
            else (model_inputs, None)
        return self.embedding(input_ids, position_ids)

    @torch.no_grad()
    def layers_riding_on(self, student_layer, hidden_states, attention_mask):
        for number in self.rides_on.get(student_layer, ()):
            hidden_states = self.layers[str(number - 1)](hidden_states, attention_mask)
        return hidden_states

    @torch.no_grad()
    def logits(self, hidden_states):
        """Final norm and head: [s, b, h] -> [s, b, vocab/tp]."""
        hidden_states = self.final_layernorm(hidden_states)
        if self.output_layer is None:
            return tied_output_logits(self.embedding, hidden_states)
        return self.output_layer(hidden_states)

    @torch.no_grad()
    def whole_model_logits(self, input_ids, position_ids=None, attention_mask=None):
        """GPTModel's forward (PP 1): every layer of the teacher."""
        hidden_states = self.embed(pack_model_inputs(input_ids, position_ids, attention_mask))
        for layer in self.layers.values():
            hidden_states = layer(hidden_states, attention_mask)
        return self.logits(hidden_states)


class DistillationLoss:
    """The model's loss_fn under --kd: outputs (student logits, teacher logits) give kd_alpha_ce x the language-
    model loss + kd_beta_ce x T^2 KL(teacher || student) averaged over the tokens; logits alone (evaluation)
    give the language-model loss. Each training micro-batch's two terms are kept for the iteration line."""

    def __init__(self, language_model_loss, config):
        self.language_model_loss, self.config = language_model_loss, config
        self.recorded = []

    def __call__(self, outputs, labels):
        if not isinstance(outputs, tuple):
            return self.language_model_loss(outputs, labels)
        student_logits, teacher_logits = outputs
        lm_loss = self.language_model_loss(student_logits, labels)
        kd_loss = vocab_parallel_kl_divergence(student_logits, teacher_logits, self.config.kd_temp).mean()
        self.recorded.append(torch.stack((lm_loss.detach().float(), kd_loss.detach().float())))
        return self.config.kd_alpha_ce * lm_loss + self.config.kd_beta_ce * kd_loss

    def begin_global_batch(self):
        self.recorded = []

    def global_batch_losses(self, device):
        """(lm loss, kd loss) of the global batch: the mean over this rank's micro-batches (the last pipeline
        stage's: the others hold none), shared over the pipeline stages; the caller averages over data parallel."""
        local = torch.stack(self.recorded).mean(dim=0) if self.recorded else torch.zeros(2)
        local = local.to(device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.all_reduce(local, group=parallel_state.get_pipeline_model_parallel_group())
        self.recorded = []
        return local


def distillation_loss_of(module):
    loss_fn = getattr(module, "loss_fn", None)
    return loss_fn if isinstance(loss_fn, DistillationLoss) else None


# --- the teacher's checkpoint ---------------------------------------------------------------------------

def resolve_teacher(config):
    """(path, tag, metadata) of --load-teacher's checkpoint (rank 0 reads the folder; every rank gets the same
    answer or the same CheckpointError)."""
    found = [None]
    if dist.get_rank() == 0:
        try:
            found = [("ok", _resolve(config.load_teacher))]
        except CheckpointError as error:
            found = [("error", str(error))]
    dist.broadcast_object_list(found, src=0)
    if found[0][0] == "error":
        raise CheckpointError(found[0][1])
    return found[0][1]


def _resolve(folder):
    try:
        tag, metadata, _ = discovery.resolve_checkpoint(folder)
    except CheckpointError as error:
        raise CheckpointError(f"--load-teacher: {error}".replace("--load-teacher: --load ", "--load-teacher ")) \
            from None
    if tag is None:
        raise CheckpointError(f"--load-teacher {folder}: no checkpoint there")
    return f"{folder.rstrip('/')}/{tag}", tag, metadata


def teacher_problems(config, student_args, metadata):
    """What makes the teacher's checkpoint unusable for this run, each naming the flag or value involved."""
    saved, shape = metadata["args"], files.saved_model_shape(metadata)
    problems = [f"{flag} {getattr(config, name)}: the teacher's checkpoint has {shape[key]}"
                for flag, name, key in _SHAPE_FLAGS
                if getattr(config, name) is not None and getattr(config, name) != shape[key]]
    if files.is_moe(shape):
        problems.append("the teacher's checkpoint holds a Mixture of Experts: not built as a teacher")
    if saved.get("vocab_size") not in (None, student_args.vocab_size):
        problems.append(f"vocabulary: the teacher's checkpoint {saved['vocab_size']} tokens, this run "
                        f"{student_args.vocab_size} (the teacher must read the student's tokens)")
    positions = shape.get("max_position_embeddings")
    if positions is not None and positions < student_args.seq_length:
        problems.append(f"the teacher learned {positions} positions, fewer than --seq-length "
                        f"{student_args.seq_length}")
    return problems


def teacher_config(student_args, saved_args):
    """The teacher's TransformerConfig: its shape from its checkpoint's arguments, how to compute from this run's
    (dtype, fused ops, sequence parallelism); no dropout or recompute."""
    args = inference_args(saved_args)
    vars(args).update({name: getattr(student_args, name) for name in _RUN_VALUES})
    return transformer_config_from_args(args), args


# --- building and attaching -----------------------------------------------------------------------------

def attach_teacher(student_args, module, pipelined):
    """Build this rank's share of the teacher, read its weights and hand it to the student's layers (GPTModel at
    PP 1, the pipeline layers of this stage otherwise). Returns the line the start-up log prints."""
    config_of_run = student_args.distillation
    path, tag, metadata = resolve_teacher(config_of_run)
    problems = teacher_problems(config_of_run, student_args, metadata)
    if problems:
        raise CheckpointError(f"--load-teacher {path} does not fit this run:\n  - " + "\n  - ".join(problems))
    config, args = teacher_config(student_args, metadata["args"])
    student_layers = _student_layers_here(module, pipelined, student_args.num_layers)
    rides_on, totals = {}, (student_args.num_layers, config.num_layers)
    for number in teacher_layers_on(student_layers, *totals):
        rides_on.setdefault(student_layer_carrying(number, *totals), []).append(number)
    # the embedding rides with the first layer's chunk, the final norm and head with the last's (whichever
    # pipeline rank holds them: DualPipeV's V puts both on rank 0)
    embedding = 1 in student_layers
    head = not pipelined or any(isinstance(part, FinalLayerNorm) for part in module.modules())
    teacher = Teacher(config, student_args.padded_vocab_size, args.max_position_embeddings,
                      not args.untie_embeddings_and_output_weights, rides_on, embedding, head)
    _read_weights(teacher, path, metadata, config.num_layers, student_args.padded_vocab_size)
    teacher.to(next(module.parameters()).device)
    if pipelined:
        for part in module.modules():
            if isinstance(part, (EmbeddingPipe, TransformerLayerPipe, FinalLayerNorm, OutputLayer)):
                object.__setattr__(part, "teacher", teacher)  # not a submodule: the engine must not see it
    else:
        object.__setattr__(module, "teacher", teacher)
    return _describe(metadata, path, config, teacher)


def _student_layers_here(module, pipelined, num_layers):
    if not pipelined:
        return list(range(1, num_layers + 1))
    return sorted(part.layer_number for part in module.modules() if isinstance(part, TransformerLayerPipe))


def _read_weights(teacher, path, metadata, num_layers, vocab_rows):
    names = dict(layout.live_parameter_names(teacher, num_layers, pipelined=False))
    target = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
              False)
    # a teacher trained with FP8 delayed scaling quantises at its saved scales (absent: fresh ones)
    scalings = {name: buffer for name, buffer in layout.live_buffer_names(teacher, num_layers, pipelined=False)
                if layout.is_fp8_scaling_state(name)}
    state = read_resharded_rank_state(path, metadata, target, list(names), vocab_rows, with_optimizer=False,
                                      buffer_names=list(scalings))
    with torch.no_grad():
        for name, param in names.items():
            param.copy_(state.weights[name].to(param.dtype))
        for name, buffer in scalings.items():
            if name in state.weights:
                buffer.copy_(state.weights[name])


def _describe(metadata, path, config, teacher):
    teacher_layers = teacher.layer_numbers
    runs = []  # the layers as runs of consecutive numbers (an interleaved or DualPipeV rank holds several)
    for number in teacher_layers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    listed = ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)
    here = (f"teacher layer{'s' if len(teacher_layers) > 1 else ''} {listed}" if teacher_layers
            else "no teacher layer")
    parameters = sum(param.numel() for param in teacher.parameters())
    return (f"knowledge distillation: teacher {path} ({checkpoint_description(metadata)}; {config.num_layers} layers, "
            f"hidden {config.hidden_size}, {config.num_attention_heads} heads) read resharded to TP "
            f"{parallel_state.get_tensor_model_parallel_world_size()}, frozen and not saved; on pipeline stage "
            f"{parallel_state.get_pipeline_model_parallel_rank()} of rank {dist.get_rank()}: {here}, "
            f"{parameters:,} teacher parameters")
