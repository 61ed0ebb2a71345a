"""Decode throughput of a transformers model on kvq's cache, per scheme, against transformers' own
(DynamicCache + SDPA): batch 1 and the largest batch whose KV cache fits a fixed budget at a long
context; end-to-end tokens/s and the attention's share of a step.

    python3 examples/python/hf_throughput.py                 # SmolLM2-135M, 8K context, 8 GiB
    python3 examples/python/hf_throughput.py --context 4096 --budget-gib 4 --schemes fp16,kivi2

Every sequence's cache is filled with ``--context`` tokens of random K and V (the kernels' time
does not depend on the values; a real 8K prefill of hundreds of sequences would only add minutes
before the measurement); then ``--steps`` greedy decode steps of the whole model run, timed with
the host clock after a device synchronisation. The attention's share is the time between CUDA
events recorded around every layer's attention call (its kernels and its host work) over the
step's time. Memory is what the cache's buffers take (kvq: the plan's buffers, every layer;
transformers: f16 K and V of every cached token). transformers runs twice: as it comes (torch's
SDPA picks cuDNN's attention) and with cuDNN's SDPA turned off, whose host time is far smaller.
"""

import argparse
import time

import torch
import transformers
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

import kvq
import kvq.hf
from kvq.eval import load_model
from kvq.hf import KvqCache

EVENTS = []


def timed(fn):
    def call(*args, **kwargs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn(*args, **kwargs)
        end.record()
        EVENTS.append((start, end))
        return out
    return call


def shape(model):
    c = model.config
    return (c.num_hidden_layers, c.num_key_value_heads,
            getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


BASELINES = {"transformers": True, "transformers, SDPA without cuDNN": False}


def bytes_per_seq(model, scheme, tokens):
    layers, kv_heads, d = shape(model)
    if scheme in BASELINES:
        return 2 * 2 * layers * kv_heads * d * tokens
    c = model.config
    limits = dict(head_dim=d, q_heads=c.num_attention_heads, kv_heads=kv_heads, max_seqs=1,
                  max_seq_len=tokens)
    pages = kvq.Plan(scheme, pool_pages=1, **limits).max_pages_per_seq
    return kvq.Plan(scheme, pool_pages=pages, **limits).total_bytes * layers


def filled_cache(model, scheme, batch, context, capacity, gen):
    """A cache of ``batch`` sequences holding ``context`` tokens of random K and V each."""
    layers, kv_heads, d = shape(model)
    if scheme in BASELINES:
        model.set_attn_implementation("sdpa_timed")
        cache = transformers.DynamicCache(config=model.config)
        for i in range(layers):
            k = torch.randn(batch, kv_heads, context, d, generator=gen, device="cuda").half()
            cache.update(k, torch.randn_like(k), i)
        return cache
    cache = KvqCache(model, scheme, max_batch=batch, max_seq_len=capacity)
    AttentionInterface.register("kvq", timed(kvq.hf._attention))
    per = max(1, (256 << 20) // (context * kv_heads * d * 2))  # sequences per 256 MiB of K
    for layer in cache.layers:
        for s0 in range(0, batch, per):
            n = min(per, batch - s0)
            k = torch.randn(n * context, kv_heads, d, generator=gen, device="cuda").half()
            layer.paged.prefill(range(s0, s0 + n), [context] * n, k, torch.randn_like(k))
        layer.lazy_initialization(k, k)
        layer.length, layer.batch = context, batch
    return cache


def measure(model, scheme, batch, context, steps, gen):
    # torch's SDPA prefers cuDNN's attention, whose host time (about 1.7 ms a call here, a plan
    # for every new length) dominates transformers' decode step; the second baseline turns it off.
    torch.backends.cuda.enable_cudnn_sdp(BASELINES.get(scheme, True))
    cache = filled_cache(model, scheme, batch, context, context + steps + 8, gen)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=gen, device="cuda")
    with torch.no_grad():
        for i in range(steps + 5):
            if i == 5:
                torch.cuda.synchronize()
                EVENTS.clear()
                t0 = time.perf_counter()
            logits = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / steps
    attention = sum(s.elapsed_time(e) for s, e in EVENTS) / 1e3 / steps
    del cache
    torch.cuda.empty_cache()
    return dict(step_ms=step * 1e3, tokens_per_s=batch / step, attention_share=attention / step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--schemes", default=",".join(n for n, gpu in kvq.builtin_schemes() if gpu))
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--budget-gib", type=float, default=8.0, help="KV cache memory budget")
    ap.add_argument("--steps", type=int, default=32)
    a = ap.parse_args()
    AttentionInterface.register("sdpa_timed", timed(sdpa_attention_forward))
    AttentionMaskInterface.register("sdpa_timed", sdpa_mask)
    model, _ = load_model(a.model, "float16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    budget = int(a.budget_gib * 2**30)
    print(f"{torch.cuda.get_device_name()}, {a.context}-token context, KV budget "
          f"{a.budget_gib:g} GiB, {a.steps} greedy steps\n")
    print("| cache | MiB a sequence | batch | step ms | tokens/s | × transformers | attention |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = {}
    for scheme in list(BASELINES) + a.schemes.split(","):
        per_seq = bytes_per_seq(model, scheme, a.context + a.steps + 8)
        biggest = budget // per_seq
        for batch in sorted({1, biggest}):
            r = measure(model, scheme, batch, a.context, a.steps, gen)
            key = "1" if batch == 1 else "max"
            base.setdefault(key, r["tokens_per_s"])
            print(f"| {scheme} | {per_seq / 2**20:.1f} | {batch} | "
                  f"{r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
                  f"{r['tokens_per_s'] / base[key]:.2f} | {r['attention_share']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
