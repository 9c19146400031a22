"""``--arch`` spellings: TORCH_CUDA_ARCH_LIST's single values are read as the
architecture they name, a list in one value is refused with a hint to repeat
``--arch``, and text that names no GPU (other scripts' digits, a zero) is refused."""

from __future__ import annotations

import pytest

from distcache.errors import ConfigError
from distcache.integrations.flashinfer._warm import arch_filter, parse_arch


@pytest.mark.parametrize(("text", "cc"), [
    ("9.0a", 90), ("10.0a", 100), ("10.0f", 100), ("9.0+PTX", 90), ("8.6+ptx", 86),
    ("sm_90a", 90), ("90", 90), (" 9.0 ", 90),
])
def test_torch_arch_list_values_name_their_architecture(text: str, cc: int) -> None:
    assert parse_arch(text) == cc


@pytest.mark.parametrize("text", ["8.0;8.6", "8.0 8.6", "8.0,8.6", "sm_80 sm_86"])
def test_a_list_in_one_value_says_to_repeat_the_option(text: str) -> None:
    with pytest.raises(ConfigError, match="one architecture per --arch") as caught:
        parse_arch(text)
    assert caught.value.variable == "--arch"  # type: ignore[attr-defined]


@pytest.mark.parametrize("text", [
    "\u0669\u0660", "sm_\u0669\u0660", "\u0669.\u0660", "\uff19\uff10",  # other digits
    "00", "sm_00", "0.0", "sm_05",  # no GPU
    "", "   ", "9.0+", "+PTX", "sm90 a",
])
def test_text_that_names_no_gpu_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--arch: bad GPU architecture"):
        parse_arch(text)


def test_a_name_with_other_digits_mentions_no_architecture() -> None:
    assert arch_filter(["sm_90"])("pin/fmha/fmhaSm\u0661\u0660\u0660aKernel.cubin")
