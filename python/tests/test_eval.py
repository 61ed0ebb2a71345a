"""The parts of kvq's model evaluation that need no GPU: the bundled texts, the teacher-forcing
schedule against a plan's page fills, and the CPU reference behind ``--reference`` against
attention computed here in plain Python."""

import math
import random
import struct

import pytest

import kvq
from kvq.eval import bundled_texts
from kvq.schedule import step_lengths
from kvq import _kvq


def test_the_bundled_texts_are_four_kinds_of_long_text():
    names = {p.stem for p in bundled_texts()}
    assert names == {"prose", "dialogue", "code", "lists"}
    for p in bundled_texts():
        text = p.read_text(encoding="utf-8")
        # 2,048 tokens of a 49K-token BPE vocabulary take more than 8,000 characters of English.
        assert len(text) > 9000, f"{p.name}: {len(text)} characters"


@pytest.mark.parametrize("seed", range(20))
def test_steps_reach_every_page_fill_with_a_step_of_one(seed):
    rng = random.Random(seed)
    tokens = rng.randrange(1, 3000)
    chunk = rng.randrange(1, 70)
    fills = sorted(rng.sample(range(1, 3200), rng.randrange(0, 30)))
    steps = step_lengths(tokens, fills, chunk)
    assert sum(steps) == tokens
    assert all(1 <= s <= chunk for s in steps)
    ends, at = {}, 0
    for s in steps:
        at += s
        ends[at] = s
    for n in fills:
        if n <= tokens:
            assert ends.get(n) == 1, f"fill at {n} reached by a step of {ends.get(n)}"
            assert n - 1 == 0 or n - 1 in ends, f"no step ends before the fill at {n}"


def test_page_fills_follow_the_scheme_windows():
    # A page of K fills every 32 tokens past the sink, one of V past its 64-token window too.
    plan = kvq.Plan("k = int(2, channel), v = int(2, token, local = 64), sink = 16, page = 32",
                    head_dim=64, q_heads=4, kv_heads=2, max_seqs=1, max_seq_len=512,
                    pool_pages=16)
    k_fills = list(range(16 + 32, 201, 32))           # K: no local window of its own
    v_fills = list(range(16 + 64 + 32, 201, 32))      # V: 64 tokens kept in FP16
    assert plan.page_fill_lengths(200) == sorted(set(k_fills + v_fills))
    fp16 = kvq.Plan("fp16", head_dim=64, q_heads=4, kv_heads=2, max_seqs=1, max_seq_len=512,
                    pool_pages=16)
    assert fp16.page_fill_lengths(500) == []


def floats(xs):
    return struct.pack(f"={len(xs)}f", *xs)


def unpack(b):
    return list(struct.unpack(f"={len(b) // 4}f", b))


def test_the_reference_of_fp16_is_causal_attention():
    """FP16 caches round to f16 and nothing else: every token's row is softmax attention over the
    tokens up to itself (inputs already f16 values), with GQA."""
    rng = random.Random(7)
    t, qh, kvh, d = 9, 4, 2, 64
    plan = kvq.Plan("fp16", head_dim=d, q_heads=qh, kv_heads=kvh, max_seqs=1, max_seq_len=16,
                    pool_pages=4, max_q_len=16)

    def halves(n):  # values exact in f16
        return [round(rng.uniform(-2, 2) * 256) / 256 for _ in range(n)]

    q, k, v = halves(t * qh * d), halves(t * kvh * d), halves(t * kvh * d)
    out, lse = _kvq._reference_every_token(plan, t, floats(q), floats(k), floats(v))
    out, lse = unpack(out), unpack(lse)
    for i in range(t):
        for h in range(qh):
            g = h // (qh // kvh)
            qr = q[(i * qh + h) * d:(i * qh + h + 1) * d]
            s = [sum(a * b for a, b in zip(qr, k[(j * kvh + g) * d:(j * kvh + g + 1) * d]))
                 / math.sqrt(d) for j in range(i + 1)]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            z = sum(w)
            for c in range(d):
                want = sum(w[j] * v[(j * kvh + g) * d + c] for j in range(i + 1)) / z
                assert out[(i * qh + h) * d + c] == pytest.approx(want, abs=1e-5)
            assert lse[i * qh + h] == pytest.approx(m + math.log(z), abs=1e-5)


def test_the_reference_names_a_wrong_size():
    plan = kvq.Plan("kivi2", head_dim=64, q_heads=4, kv_heads=2, max_seqs=1, max_seq_len=16,
                    pool_pages=4)
    with pytest.raises(kvq.InvalidArgument, match="k holds 4 bytes"):
        _kvq._reference_every_token(plan, 2, floats([0.0] * 512), b"\0" * 4, b"\0" * 1024)
