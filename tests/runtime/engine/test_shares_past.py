"""scheduler.shares_past: the rule that holds a request back while another one prefills a prompt
with more of its blocks than the prefix cache holds, against a block-by-block reference."""

from __future__ import annotations

import random

from mlac.runtime.engine.sequence import shares_past


def shared_full_blocks(a: list[int], b: list[int], block_size: int) -> int:
    n = 0
    while (n + 1) * block_size <= min(len(a), len(b)) and a[: (n + 1) * block_size] == b[
        : (n + 1) * block_size
    ]:
        n += 1
    return n


def test_it_matches_the_block_by_block_rule_on_random_prompts():
    rng = random.Random(0)
    bs, checked, true = 4, 0, 0
    for _ in range(3000):
        base = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]  # small vocab: long shared runs
        a = base + [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        b = base[: rng.randrange(0, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
        cached = bs * rng.randrange(0, 8) + rng.choice([0, 0, 1, 3])  # block multiples, and not
        want = shared_full_blocks(a, b, bs) * bs > cached
        assert shares_past(a, b, cached, bs) == want, (a, b, cached)
        checked, true = checked + 1, true + want
    assert 300 < true < checked - 300  # both answers well represented


def test_a_burst_sharing_only_the_cached_prompt_is_not_held():
    system = list(range(100, 2100))  # 2,000 tokens: 125 blocks of 16, all cached
    a, b = system + [1] * 64, system + [2] * 64
    assert not shares_past(a, b, 2000, 16)
    assert shares_past(a, system + [1] * 16 + [2] * 48, 2000, 16)  # one more full block in common
