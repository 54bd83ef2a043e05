"""DAPO's soft overlong punishment, as a reward part.

DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.4, "Soft Overlong Punishment"), with
``L = sample["response_len"]`` tokens, ``L_max`` the length limit and ``L_cache`` the buffer::

    R_length = 0                                 if L <= L_max - L_cache
               (L_max - L_cache - L) / L_cache   if L_max - L_cache < L <= L_max
               -1                                if L > L_max

times ``penalty_factor`` (1.0 in the paper). Inside the buffer this is exactly verl's
``verl/workers/reward_manager/dapo.py`` (``min(-(L - (max_resp_len - overlong_buffer.len)) /
overlong_buffer.len * penalty_factor, 0)``); verl never sees ``L > L_max`` because its generation
stops there, and here that case is the paper's flat -1 (reachable when ``max_len`` is set below
the generation limit). Add it beside the task reward in ``[reward] functions``.
"""
from __future__ import annotations

from typing import Any

from rewards import register


@register("overlong")
def overlong_penalty(response: str, sample: dict[str, Any], max_len: int | None = None,
                     buffer: int = 0, penalty_factor: float = 1.0) -> dict[str, float]:
    """``{"reward": p, "overlong": p}`` with ``p`` in ``[-penalty_factor, 0]`` as above.

    ``max_len`` defaults to ``sample["max_new_tokens"]`` (the generation limit; then only the
    buffer zone matters, since no response is longer). ``buffer`` is DAPO's ``L_cache``; with
    ``buffer=0`` the penalty is a hard -1 beyond ``max_len``.
    """
    length = int(sample["response_len"])
    limit = int(sample["max_new_tokens"] if max_len is None else max_len)
    if limit <= 0 or not 0 <= buffer <= limit:
        raise ValueError(f"need max_len > 0 and 0 <= buffer <= max_len, got {limit}, {buffer}")
    if length <= limit - buffer:
        p = 0.0
    elif length <= limit:
        p = (limit - buffer - length) / buffer * penalty_factor
    else:
        p = -1.0 * penalty_factor
    return {"reward": p, "overlong": p}
