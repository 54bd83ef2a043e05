"""Toy rewards a tiny random policy can learn in minutes (CPU demo and learning tests).

They prove the loop (sampling, advantages, the sign of the gradient, weight sync), not that the
model can do geometry: a random tiny model's geometry accuracy stays near zero.
"""
from __future__ import annotations

from rewards import register


@register("target_fraction")
def target_fraction(response: str, sample: dict, target: str = "<answer>") -> dict[str, float]:
    """Fraction of response tokens that are `target` (a single token in the tiny tokenizer).

    Counted in the decoded text and divided by the response length in tokens, so it equals the
    token fraction when `target` is one token.
    """
    n = max(1, int(sample.get("response_len", 0)))
    frac = min(1.0, response.count(target) / n)
    return {"reward": frac, "target_fraction": frac}
