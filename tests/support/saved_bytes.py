"""What a module's forward leaves saved for its backward, measured."""
import weakref

import torch


def saved_bytes_after_forward(layer, hidden_states):
    """Bytes of the distinct storages the layer's forward leaves saved for backward (parameters excluded): every
    saved tensor seen by saved_tensors_hooks whose autograd node is still alive after the forward."""
    parameters = {param.untyped_storage().data_ptr() for param in layer.parameters()}
    packed = []

    class Saved:
        def __init__(self, tensor):
            self.tensor = tensor

    def pack(tensor):
        saved = Saved(tensor)
        packed.append((weakref.ref(saved), tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved: saved.tensor):
        output = layer(hidden_states)
    output = output[0] if isinstance(output, tuple) else output  # an MLP's (output, bias)
    alive = {pointer: size for reference, pointer, size in packed
             if reference() is not None and pointer not in parameters}
    output.float().sum().backward()  # the layer trains with what it saved
    return sum(alive.values())
