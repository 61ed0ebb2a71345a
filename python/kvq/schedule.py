"""Steps of a teacher-forced pass through a kvq cache that show every token the cache decoding
would have shown it.

A step of several tokens appends them all, then attends each over the tokens up to itself. That is
what one-token decoding computes, except where a page fills inside the step: decoding showed the
tokens before the filling one that page's tokens in FP16, a step shows them quantized. So a step
ends just before each length at which a page fills (:meth:`kvq.Plan.page_fill_lengths`), and the
filling token goes alone.

>>> step_lengths(10, [4, 8], chunk=3)
[3, 1, 3, 1, 2]
>>> sum(step_lengths(1000, [160, 288, 416], chunk=32))
1000
"""

from typing import Iterable, List

__all__ = ["step_lengths"]


def step_lengths(tokens: int, fill_lengths: Iterable[int], chunk: int) -> List[int]:
    """Lengths of the steps that take a sequence from 0 to ``tokens`` tokens: at most ``chunk``
    tokens each, and each cache length in ``fill_lengths`` reached by a step of one token."""
    if chunk < 1:
        raise ValueError(f"chunk is {chunk}; a step takes at least one token")
    if tokens < 0:
        raise ValueError(f"tokens is {tokens}")
    # Step ends: every length whose token fills a page, and the length just before it.
    cuts = set()
    for n in fill_lengths:
        if 1 <= n <= tokens:
            cuts.update((n - 1, n))
    cuts.discard(0)
    cuts.add(tokens)
    steps, at = [], 0
    for end in sorted(cuts):
        while end - at > chunk:
            steps.append(chunk)
            at += chunk
        if end > at:
            steps.append(end - at)
            at = end
    return steps
