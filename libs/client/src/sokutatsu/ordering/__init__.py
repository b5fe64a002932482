"""Extended ATOP ordering (seed 002): the deterministic schedule and the receivers' merge.

Shared by the sequencer service, the SDK's ``OrderedSubscriber`` and the simulator; shipped by
``sokutatsu-client`` (the SDK needs it, and it needs nothing but the generated stamps).
"""

from sokutatsu.client.errors import OrderingError
from sokutatsu.ordering.merge import Entry, Kind, MergeCounters, OrderedMerge
from sokutatsu.ordering.schedule import (
    DEFAULT_MIN_PPM,
    TOTAL_PPM,
    Distribution,
    draw_ppm,
    equal_weights,
    idle_deficit,
    mix64,
    schedule,
    share_deficit,
    weights_from_counts,
)

__all__ = [
    "DEFAULT_MIN_PPM",
    "TOTAL_PPM",
    "Distribution",
    "Entry",
    "Kind",
    "MergeCounters",
    "OrderedMerge",
    "OrderingError",
    "draw_ppm",
    "equal_weights",
    "idle_deficit",
    "mix64",
    "schedule",
    "share_deficit",
    "weights_from_counts",
]
