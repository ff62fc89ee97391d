"""Shared test settings: hypothesis profiles and golden-file helpers.

Profiles: ``ci`` (derandomized, the default under CI=true or tools/test) and ``dev``
(random, more examples). Pick one with ``HYPOTHESIS_PROFILE=dev``.
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Two cores: keep intra-op threads fixed so runs are comparable and reproducible.
torch.set_num_threads(min(2, torch.get_num_threads()))
