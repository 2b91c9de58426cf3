"""Where a layer call's examples are (dpexp/privacy/layout.py): the views a rule reads them through, and the
layouts the sizes allow (dpexp/privacy/verification.check_use), never one chosen from sizes alone."""

from __future__ import annotations

import torch
from torch import nn

from dpexp.privacy.capture import Use, discover_layers
from dpexp.privacy.layout import BATCH_FIRST, TIME_MAJOR, Layout
from dpexp.privacy.verification import check_use, is_time_major_shaped


def test_the_views_put_example_i_in_row_i():
    t = torch.arange(2 * 3 * 4).view(2, 3, 4)  # (T, b, F) = (2, 3, 4) read time-major
    assert torch.equal(TIME_MAJOR.batch_first(t, 3)[1], t[:, 1])
    flat = torch.arange(6 * 4).view(6, 4)  # (b*T, F), b = 3, T = 2, example-major
    assert torch.equal(Layout(fold=2).batch_first(flat, 3)[1], flat[2:4])
    assert BATCH_FIRST.batch_first(flat, 6) is flat
    assert [ly.describe() for ly in (BATCH_FIRST, Layout(fold=2), TIME_MAJOR)] == [
        "batch-first",
        "2 rows per example, flattened into dim 0",
        "time-major (examples in dim 1)",
    ]


def test_a_time_major_shape_needs_a_feature_axis_after_the_examples():
    x, dy = torch.zeros(5, 3, 4), torch.zeros(5, 3, 2)
    assert is_time_major_shaped(x, dy, 3)
    assert not is_time_major_shaped(x, dy, 5)  # dim 1 is not the batch
    assert not is_time_major_shaped(torch.zeros(5, 3), torch.zeros(5, 2), 3)  # (T, F) with F = b
    assert is_time_major_shaped(torch.zeros(5, 3, dtype=torch.long), torch.zeros(5, 3, 4), 3)  # ids


def _use(layer_type: nn.Module, x: torch.Tensor) -> Use:
    model = nn.Sequential(layer_type)
    (layer,), _ = discover_layers(model, generic_fallback=True)
    return Use(layer, (x,), {}, [x._version])


def test_the_sizes_allow_every_layout_that_fits_them_dim_0_first():
    linear = nn.Linear(4, 2)
    # T = b = 3: batch-first and time-major both fit; only the probe can tell
    assert check_use(_use(linear, torch.zeros(3, 3, 4)), torch.zeros(3, 3, 2), 3) == [BATCH_FIRST, TIME_MAJOR]
    # T = 6 = 2 b: a fold of 2 rows or time-major
    assert check_use(_use(linear, torch.zeros(6, 3, 4)), torch.zeros(6, 3, 2), 3) == [
        Layout(fold=2),
        TIME_MAJOR,
    ]
    assert check_use(_use(linear, torch.zeros(5, 3, 4)), torch.zeros(5, 3, 2), 3) == [TIME_MAJOR]
    # a rule that acts on whole examples (a convolution) reads dim 0 only
    conv = nn.Conv1d(4, 2, 1)
    assert check_use(_use(conv, torch.zeros(3, 4, 3)), torch.zeros(3, 2, 3), 3) == [BATCH_FIRST]
