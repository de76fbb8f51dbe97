"""planning/dry_run/step_checks.py: which axis a recorded collective's bytes count on."""
from megatron_ds.planning.dry_run.step_checks import recorded_traffic


def _record(groups, ops):
    return {"groups": {"ours": groups}, "step": {"ops": ops}}


def _all_reduce(ranks, sent):
    return {"op": "allreduce", "group": ranks, "bytes": sent, "sent": sent}


def test_an_all_reduce_over_the_first_and_last_stage_is_the_tie_group_only_where_deepspeed_made_one():
    """At PP 2 the pipeline group's ranks are those of DeepSpeed's tie group too: DeepSpeed's pipeline engine sums
    its two losses (8 bytes) over the pipeline group whether the embedding is tied or not."""
    pipeline = {"pipeline": [0, 1], "tensor": [0], "sequence-data": [0]}
    loss_sum, embedding_gradient = _all_reduce([0, 1], 8.0), _all_reduce([0, 1], 4096.0)
    assert recorded_traffic(_record(pipeline, [loss_sum])) == {"pipeline collectives": 8.0}
    tied = {**pipeline, "tied": [0, 1]}
    assert recorded_traffic(_record(tied, [embedding_gradient])) == {"tied": 4096.0}
    four_stages = {"pipeline": [0, 1, 2, 3], "tied": [0, 3], "tensor": [0], "sequence-data": [0]}
    assert recorded_traffic(_record(four_stages, [_all_reduce([0, 3], 4096.0), _all_reduce([0, 1, 2, 3], 8.0)])) == \
        {"tied": 4096.0, "pipeline collectives": 8.0}
