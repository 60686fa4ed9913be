"""bench.multimodal's parts that need no server (the benchmark itself starts one per scheme)."""

import pytest

from bench.multimodal import CASES, agreement, image_part, main


def test_agreement_counts_tokens_before_the_first_divergence():
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert agreement([1, 2], [1, 2, 3]) == 2
    assert agreement([5], [6]) == 0


def test_images_are_distinct_pngs():
    urls = {image_part(s)["image_url"]["url"] for c in CASES for s in c[1]}
    assert len(urls) == sum(len(c[1]) for c in CASES)
    assert all(u.startswith("data:image/png;base64,") for u in urls)


def test_reference_must_come_first():
    with pytest.raises(SystemExit):
        main(["--kv-cache-dtype", "vidkv,bfloat16"])
