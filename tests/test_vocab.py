"""memguard.vocab: precision names and meanings, the default-precision rule, byte units."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memguard.errors import ConfigError
from memguard.vocab import (
    GiB,
    MiB,
    PRECISIONS,
    default_precisions,
    format_bytes,
    normalize_precision,
    parse_bytes,
    precision_spec,
    round_up,
)


@pytest.mark.parametrize(
    "name, param_dtype, autocast_dtype, loss_scale",
    [
        # Lightning's MixedPrecision/HalfPrecision plugins (lightning/fabric/plugins/precision/amp.py, half.py)
        ("32-true", None, None, False),
        ("16-mixed", None, torch.float16, True),  # fp16 needs a GradScaler: its exponent range is small
        ("bf16-mixed", None, torch.bfloat16, False),  # bf16 has fp32's exponent range: no scaler
        ("16-true", torch.float16, None, False),
        ("bf16-true", torch.bfloat16, None, False),
    ],
)
def test_precision_meanings(name, param_dtype, autocast_dtype, loss_scale) -> None:
    spec = precision_spec(name)
    assert (spec.param_dtype, spec.autocast_dtype, spec.loss_scale) == (param_dtype, autocast_dtype, loss_scale)
    assert spec.mixed == name.endswith("-mixed")
    assert spec.sixteen_bit == (name != "32-true")
    assert spec.compute_dtype == (autocast_dtype or param_dtype or torch.float32)


def test_aliases_and_unknown_names() -> None:
    assert [normalize_precision(a) for a in ("32", "16", "bf16")] == ["32-true", "16-mixed", "bf16-mixed"]
    assert PRECISIONS == ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
    with pytest.raises(ConfigError, match="fp8"):
        precision_spec("fp8")


def test_default_precisions_follow_the_gpu() -> None:
    ampere = SimpleNamespace(bf16=True, tensor_cores=True)
    volta = SimpleNamespace(bf16=False, tensor_cores=True)
    pascal = SimpleNamespace(bf16=False, tensor_cores=False)
    assert default_precisions("cuda", ampere) == ("bf16-mixed", "32-true")
    assert default_precisions("cuda", volta) == ("16-mixed", "32-true")
    assert default_precisions("cuda", pascal) == ("32-true",)
    assert default_precisions("cpu") == ("32-true", "bf16-mixed")


def test_bytes() -> None:
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(-(MiB + MiB // 2)) == "-1.50 MiB"
    assert format_bytes(12) == "12 B"
    # GB is decimal, GiB and the bare G binary (as `free -g` and docker read them)
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 GiB") == 3 * GiB // 2
    assert parse_bytes("512m") == 512 * MiB
    for bad in ("", "12 parsecs", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    assert round_up(1, 2 * MiB) == 2 * MiB and round_up(0, 512) == 0 and round_up(1024, 512) == 1024
