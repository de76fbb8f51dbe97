"""Resilience to faults that do not crash a run.

    rerun.py       --rerun-mode: a device's transient fault told from a result the data or model really gives
    stragglers.py  --log-straggler: which ranks compute slower than their peers
"""
