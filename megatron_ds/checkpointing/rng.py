"""Every random number generator a rank draws from (Python, NumPy, torch, CUDA, the TP RNG tracker),
saved per rank into the checkpoint folder (files.rng_file_name) and restored for an exact resume."""
import random

import numpy as np
import torch

from megatron_ds.core.tensor_parallel import get_cuda_rng_tracker


def collect_rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])
