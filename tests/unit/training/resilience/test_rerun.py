"""--rerun-mode's flags, checked at start-up. The modes on real ranks: tests/e2e/test_rerun.py."""
import re

import pytest

from megatron_ds.arguments import ArgumentsError, parse_args
from tests.support.layouts import COMMON


@pytest.mark.parametrize("flags, message", [
    (["--check-for-spiky-loss"], "--check-for-spiky-loss needs --rerun-mode validate_results (got --rerun-mode "
                                 "disabled)"),
    (["--rerun-mode", "validate_results", "--skip-spiky-batches"], "--skip-spiky-batches needs --check-for-spiky-loss"),
    (["--rerun-mode", "validate_results", "--error-injection-rate", "-1"], "--error-injection-rate must be >= 0"),
    (["--rerun-mode", "validate_results", "--spiky-loss-factor", "1"], "--spiky-loss-factor must be > 1, got 1.0"),
    (["--error-injection-rate", "3"], "--error-injection-rate needs --rerun-mode validate_results or report_stats"),
    (["--rerun-mode", "report_stats", "--rerun-stats-interval", "0"], "--rerun-stats-interval must be >= 1, got 0"),
    (["--rerun-mode", "report_stats", "--zero-stage", "3"], "--rerun-mode report_stats does not support ZeRO stage 3"),
])
def test_the_rerun_flags_are_checked_at_start_up(flags, message):
    with pytest.raises(ArgumentsError, match=re.escape(message)):
        parse_args(COMMON + flags)
