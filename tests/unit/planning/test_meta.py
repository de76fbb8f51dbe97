"""megatron_ds.planning.meta: pipeline stages built with the real model code on the meta device, split where
training splits them (even, or Megatron-LM's uneven split), agree with the parameter formulas."""
import pytest

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import gpt_layer_specs
from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.planning.meta import check_against_formula, meta_stage_parameter_counts, stage_boundaries
from megatron_ds.planning.parameters import layers_per_stage
from tests.support.planning_specs import FAMILIES, small_model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp,pp,layers", [(1, 2, 4), (2, 2, 4), (1, 4, 4), (4, 2, 2), (2, 3, 6)])
def test_parameter_formula_matches_meta_built_stages(family, tied, tp, pp, layers):
    model = small_model(family, tied, layers=layers)
    checks = check_against_formula(model, tp, pp)
    assert sorted(checks) == list(range(pp))
    assert all(row["difference"] == 0 for row in checks.values()), checks


def test_stage_boundaries_give_each_stage_its_share_of_layers():
    """specs: embedding, 6 layers, final norm, head; 3 stages of 2 layers, embedding first, norm and head last."""
    model = small_model("gpt2", tied=False, layers=6)
    with parallel_state.simulated_model_parallel(1, 0, 3, 0):
        specs = gpt_layer_specs(model.config, model.padded_vocab_size(1), model.max_position_embeddings, False)
    bounds = stage_boundaries(specs, 6, 3)
    assert bounds == [0, 3, 5, 9] and len(specs) == 9
    layers = [sum(spec.typename.__name__.startswith("TransformerLayer") for spec in specs[start:stop])
              for start, stop in zip(bounds, bounds[1:])]
    assert layers == layers_per_stage(6, 3) == [2, 2, 2]


@pytest.mark.parametrize("split, expected_layers, expected_bounds", [
    (PipelineSplit(first_stage_layers=1, last_stage_layers=1), [1, 4, 1], [0, 2, 6, 9]),
    # (6 + 2) / 4: the first and the last stage one layer less; a stage may hold no layer at all
    (PipelineSplit(account_for_embedding=True, account_for_loss=True), [1, 2, 2, 1], [0, 2, 4, 6, 9]),
])
def test_uneven_stage_boundaries_cut_where_the_split_says(split, expected_layers, expected_bounds):
    model = small_model("gpt2", tied=False, layers=6)
    pp = len(expected_layers)
    with parallel_state.simulated_model_parallel(1, 0, pp, 0):
        specs = gpt_layer_specs(model.config, model.padded_vocab_size(1), model.max_position_embeddings, False)
    bounds = stage_boundaries(specs, 6, pp, split)
    assert bounds == expected_bounds
    assert layers_per_stage(6, pp, split) == expected_layers


@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_formula_matches_meta_built_uneven_stages(tp):
    """1 + 4 + 1 layers: the first stage holds the embedding and a layer, the last a layer, the norm and head."""
    model = small_model("llama", False, layers=6)
    split = PipelineSplit(first_stage_layers=1, last_stage_layers=1)
    checks = check_against_formula(model, tp, 3, split=split)
    assert all(row["difference"] == 0 for row in checks.values()), checks
    even_middle = meta_stage_parameter_counts(model, tp, 3, stages=[1], tp_rank=0)[1]  # 2 layers
    assert checks[1]["built"] == 2 * even_middle


def test_middle_stage_of_one_tp_rank_holds_only_its_layers():
    """gpt2, h 32: a layer is 12h^2 + 13h = 12704 parameters, split over TP 2: 6h^2 + 3.5h sharded
    (6144 + 112) + 2h row-parallel biases + 4h LayerNorm replicated = 6448."""
    model = small_model("gpt2", layers=6)
    assert meta_stage_parameter_counts(model, tp=2, pp=3, stages=[1]) == {1: 2 * 6448}
