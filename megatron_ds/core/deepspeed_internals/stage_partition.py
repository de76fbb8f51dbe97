"""PipelineModule's stage boundaries given, not computed: DeepSpeed 0.19.8 partitions the layer specs uniformly,
by parameter counts or by a layer type's count only (PipelineModule._partition_layers), so an uneven split of the
transformer layers (core/pipeline_split.py) is handed to it as the boundaries themselves.

`with_stage_boundaries(module_class, parts)` is module_class (PipelineModule, DeepSpeed's DualPipeVModule or the
interleaved module) whose `_partition_layers` sets `parts` (model stage s holds the layer specs parts[s] to
parts[s + 1] - 1) instead of computing them; DualPipeVModule's and the interleaved module's own bookkeeping (their
stage count, each phase's bounds) runs around it unchanged.
"""
from deepspeed.runtime.pipe.module import PipelineModule


class _GivenStageBoundaries(PipelineModule):
    stage_boundaries = ()

    def _partition_layers(self, method="uniform"):
        parts = list(self.stage_boundaries)
        if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs):
            raise ValueError(f"stage boundaries {parts} do not cut the {len(self._layer_specs)} layer specs into "
                             f"{self.num_stages} stages")
        self.parts = parts
        self._set_bounds(start=parts[self.stage_id], stop=parts[self.stage_id + 1])


def with_stage_boundaries(module_class, parts):
    """module_class whose model stage s holds the layer specs parts[s] to parts[s + 1] - 1 (the constructor's
    partition_method is ignored)."""
    if module_class is PipelineModule:
        return type("PipelineModuleWithGivenStages", (_GivenStageBoundaries,), {"stage_boundaries": tuple(parts)})
    return type(f"{module_class.__name__}WithGivenStages", (module_class, _GivenStageBoundaries),
                {"stage_boundaries": tuple(parts)})
