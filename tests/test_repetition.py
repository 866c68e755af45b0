"""Loop detection used to cut degenerate answers during regeneration."""
from __future__ import annotations

import random

from dspark.train.repetition import is_looping


def test_exact_loop_is_caught_and_varied_text_is_not():
    rng = random.Random(0)
    varied = [rng.randrange(49152) for _ in range(400)]
    assert not is_looping(varied)
    loop = varied[:100] + [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133] * 20
    assert is_looping(loop)
    assert not is_looping(loop[:150])  # shorter than the window: never judged


def test_near_loop_with_sampling_noise_is_caught_but_a_few_repeats_are_not():
    rng = random.Random(1)
    line = [rng.randrange(49152) for _ in range(24)]
    noisy = []
    for k in range(12):
        copy = list(line)
        if k % 3 == 0:
            copy[rng.randrange(24)] = rng.randrange(49152)  # every third repeat has one token changed
        noisy += copy
    assert is_looping(noisy)
    # Two repeats of a line inside otherwise new text: ordinary structure, not a loop.
    text = [rng.randrange(49152) for _ in range(150)] + line + line
    assert not is_looping(text)
