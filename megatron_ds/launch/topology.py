"""Where the parallel groups land on the hardware: the TP-across-nodes warning and --print-topology."""
import socket

import torch.distributed as dist

from megatron_ds.core import parallel_state


def tensor_parallel_placement_warning(tensor_parallel_size, ranks_per_node):
    """A warning when TP groups (consecutive ranks) would span nodes, else None."""
    if ranks_per_node % tensor_parallel_size == 0:
        return None
    inside = max(d for d in range(1, min(tensor_parallel_size, ranks_per_node) + 1)
                 if ranks_per_node % d == 0 and tensor_parallel_size % d == 0)
    return (f"tensor-parallel groups of {tensor_parallel_size} ranks span nodes ({ranks_per_node} ranks per node): "
            f"each layer's TP all-reduces then cross the inter-node network, typically 10-20x slower than the "
            f"intra-node links (e.g. 25-50 GB/s InfiniBand per GPU against 300-900 GB/s NVLink). Keep TP inside "
            f"a node: --tensor-model-parallel-size {inside} (a divisor of {ranks_per_node}) and move the factor "
            f"{tensor_parallel_size // inside} into --pipeline-model-parallel-size or data parallelism.")


def describe_ranks():
    """One line per rank: host, coordinates and group members (gathered from every rank)."""
    topology = parallel_state.get_topology()
    sequence = (f" | SP group {parallel_state.get_sequence_parallel_ranks()}"
                if parallel_state.get_sequence_parallel_world_size() > 1 else "")
    mine = (dist.get_rank(), socket.gethostname(), str(topology.get_coord(dist.get_rank())),
            parallel_state.get_tensor_model_parallel_ranks(), parallel_state.get_pipeline_model_parallel_ranks(),
            parallel_state.get_data_parallel_ranks(), sequence)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [f"rank {rank:>5} on {host}: {coord} | TP group {tp} | PP group {pp} | DP group {dp}{sp}"
            for rank, host, coord, tp, pp, dp, sp in everyone]
