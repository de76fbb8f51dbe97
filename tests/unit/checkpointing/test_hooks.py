"""The save-phase hook (megatron_ds.checkpointing.hooks): a writer reaches the publishing phases in order,
and the hook is gone once removed."""
import pytest

from megatron_ds.checkpointing import hooks
from tests.support.checkpoints import tiny_checkpoint


@pytest.fixture
def reached():
    phases = []
    previous = hooks.set_save_phase_hook(lambda phase, iteration: phases.append((phase, iteration)))
    yield phases
    hooks.set_save_phase_hook(previous)


def test_a_writer_reaches_the_publishing_phases_in_order(tmp_path, reached):
    tiny_checkpoint(tmp_path, 4)
    assert reached == [("metadata", "4"), ("pointers", "4"), ("between-pointers", "4")]


def test_unknown_phases_are_refused_and_a_removed_hook_is_not_called(reached):
    with pytest.raises(ValueError, match="unknown save phase"):
        hooks.reached_save_phase("metadta", "4")
    hooks.set_save_phase_hook(None)
    hooks.reached_save_phase("metadata", "4")
    assert reached == []
