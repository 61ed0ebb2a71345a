"""Captures a transformers model's attention inputs as the safetensors file `kvq eval` reads.

    python3 examples/python/capture.py --out capture.safetensors --layers 0,15,29
    kvq eval --scheme kivi2 --kv capture.safetensors            # every decode step of the text
    kvq eval --scheme xquant2 --kv capture.safetensors --rope-theta 100000

For each listed layer: K and V after RoPE (`layer.{i}.k`, `layer.{i}.v`, `[tokens, kv_heads,
head_dim]`), every token's queries (`layer.{i}.q`, `[tokens, q_heads, head_dim]`), the keys before
RoPE (`layer.{i}.k_pre_rope`), the layer's normalised input and its K/V projections (`layer.{i}.x`,
`layer.{i}.w_k`, `layer.{i}.w_v`, in × out), and K before RoPE and V of another text as CommVQ's
calibration tokens (`calib.{i}.k_pre_rope`, `calib.{i}.v`). The model runs once per text with a
hook on each listed layer's attention; the projections are recomputed from its input in float32
(Llama-style attention without biases: a model with K/V biases is refused). Prints the RoPE base.
"""

import argparse

import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvq.eval import bundled_texts, load_model


def capture(model, ids, layers):
    """Each listed layer's normalised input and (cos, sin), from one forward over ``ids``."""
    seen = {}

    def hook(i):
        def pre(module, args, kwargs):
            seen[i] = (kwargs["hidden_states"][0].float(),
                       tuple(t[0].float() for t in kwargs["position_embeddings"]))
        return pre

    handles = [model.model.layers[i].self_attn.register_forward_pre_hook(hook(i), with_kwargs=True)
               for i in layers]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    return seen


def project(attn, x, cos_sin, heads, kv_heads, d):
    if any(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj)):
        raise SystemExit("a model with q/k/v biases: XQuant's rematerialisation would differ")
    t = x.shape[0]
    q = (x @ attn.q_proj.weight.float().T).view(t, heads, d)
    k = (x @ attn.k_proj.weight.float().T).view(t, kv_heads, d)
    v = (x @ attn.v_proj.weight.float().T).view(t, kv_heads, d)
    cos, sin = cos_sin
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin,
                                        unsqueeze_dim=0)
    return q_rot.transpose(0, 1), k_rot.transpose(0, 1), k, v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--text", default="prose", help="a bundled text's stem, or a file")
    ap.add_argument("--calibration", default="dialogue", help="the calibration text")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration-tokens", type=int, default=1024)
    ap.add_argument("--layers", default="0,15,29")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok = load_model(a.model, "float16")
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    d = getattr(c, "head_dim", None) or c.hidden_size // heads
    layers = [int(i) for i in a.layers.split(",")]

    def ids(name, n):
        texts = {p.stem: p for p in bundled_texts()}
        text = open(texts.get(name, name), encoding="utf-8").read()
        return torch.tensor([tok(text, add_special_tokens=False).input_ids[:n]], device="cuda")

    out = {}
    main_in = capture(model, ids(a.text, a.tokens), layers)
    calib_in = capture(model, ids(a.calibration, a.calibration_tokens), layers)
    for i in layers:
        attn = model.model.layers[i].self_attn
        x, cos_sin = main_in[i]
        q, k, k_pre, v = project(attn, x, cos_sin, heads, kv_heads, d)
        _, _, ck_pre, cv = project(attn, *calib_in[i], heads, kv_heads, d)
        tensors = {"k": k, "v": v, "q": q, "k_pre_rope": k_pre, "x": x,
                   "w_k": attn.k_proj.weight.float().T, "w_v": attn.v_proj.weight.float().T}
        for name, t in tensors.items():
            out[f"layer.{i}.{name}"] = t.half().contiguous().cpu()
        out[f"calib.{i}.k_pre_rope"] = ck_pre.half().contiguous().cpu()
        out[f"calib.{i}.v"] = cv.half().contiguous().cpu()
    save_file(out, a.out)
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    print(f"{a.out}: layers {layers}, {x.shape[0]} tokens; --rope-theta "
          f"{theta or getattr(c, 'rope_theta', '?')}")


if __name__ == "__main__":
    main()
