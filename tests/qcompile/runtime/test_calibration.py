"""``nonfinite_count`` against numpy's own count, for every float dtype a weight may have
(float8 has no ``aminmax`` kernel: the other path), NaN and infinities anywhere."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from qcompile.runtime.calibration import nonfinite_count

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]


@given(st.sampled_from(DTYPES), st.integers(0, 300),
       st.lists(st.sampled_from([math.nan, math.inf, -math.inf]), max_size=4),
       st.integers(0, 2 ** 16))
def test_nonfinite_count_is_numpys(dtype: torch.dtype, n: int, bad: list[float],
                                   seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if n:
        where = torch.randint(0, n, (len(bad),), generator=g)
        x[where] = torch.tensor(bad, dtype=torch.float64)
    x = x.to(dtype)
    ref = x.to(torch.float64).numpy()  # every value of these dtypes is a float64 value
    want = (int(np.isnan(ref).sum()), int(np.isinf(ref).sum()))
    assert nonfinite_count(x) == want
    assert nonfinite_count(x.view(-1, 1).t()) == want  # not contiguous


def test_integer_and_meta_tensors_count_nothing() -> None:
    assert nonfinite_count(torch.arange(5)) == (0, 0)
    assert nonfinite_count(torch.empty(3, device="meta")) == (0, 0)
