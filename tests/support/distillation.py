"""The distillation tests' model flags and the distillation term as Megatron-DeepSpeed computes it."""
import torch.nn.functional as F

MODEL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings",
         "32", "--vocab-size", "128", "--make-vocab-size-divisible-by", "32", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--mock-data", "--log-interval", "1", "--hidden-dropout", "0",
         "--attention-dropout", "0"]


def reference_kl(student, teacher, temperature):
    """T^2 KL(softmax(teacher / T) || softmax(student / T)) per token, as Megatron-DeepSpeed computes it."""
    log_student, log_teacher = F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1)
    return temperature ** 2 * F.kl_div(log_student, log_teacher, log_target=True, reduction="none").sum(-1)
