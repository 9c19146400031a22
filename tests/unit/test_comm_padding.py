"""How wide the torch transport pads an all-gather (comm/_torch.py: padded_width)."""

from __future__ import annotations

from distcache.comm._torch import PAD_ALLOWANCE, padded_width


def test_equal_parts_are_padded_to_their_length() -> None:
    assert padded_width([100] * 64) == 100


def test_one_long_part_among_short_ones_is_left_to_a_broadcast_of_its_own() -> None:
    lengths = [10] * 255 + [50_000_000]
    width = padded_width(lengths)
    assert width == 10
    held = width * len(lengths) + sum(n for n in lengths if n > width)
    assert held <= 3 * sum(lengths)


def test_what_a_rank_holds_stays_within_twice_the_total_plus_the_allowance() -> None:
    for lengths in ([0] * 8, [1, 2, 3, 4000], [5000] * 3 + [1] * 500, list(range(300))):
        width = padded_width(lengths)
        assert width * len(lengths) <= 2 * sum(lengths) + PAD_ALLOWANCE
        assert width <= max(lengths)
