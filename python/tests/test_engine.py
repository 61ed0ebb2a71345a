"""kvq.engine on a CUDA GPU through PyTorch: prefill, append and attend on torch tensors, checked
against attention computed by torch, replayed from a CUDA graph and traced by torch.compile with
the same bits as eager calls, and merged across parts of a sequence. Skipped without torch or a
GPU (the Rust tests in crates/kvq-capi check the same calls bit for bit against kvq's own cache)."""

import math

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU for torch", allow_module_level=True)

import kvq  # noqa: E402
from kvq.engine import PagedCache, merge  # noqa: E402

KV_HEADS, GQA, HEAD_DIM = 2, 4, 128
Q_HEADS = KV_HEADS * GQA


def make(scheme, dtype=torch.float16, max_seqs=4, max_seq_len=1024, max_q_len=1):
    limits = dict(head_dim=HEAD_DIM, q_heads=Q_HEADS, kv_heads=KV_HEADS, max_seqs=max_seqs,
                  max_seq_len=max_seq_len, dtype=dtype, max_q_len=max_q_len)
    pages = kvq.Plan(scheme, pool_pages=1, **limits).max_pages_per_seq
    plan = kvq.Plan(scheme, pool_pages=max_seqs * pages, **limits)
    return plan, PagedCache(plan, "cuda")


def exact(q, k, v):
    """softmax(q·kᵀ/√d)·v and the log-sum-exp in float64: q [q_heads, d], k/v [t, kv_heads, d]."""
    q, k, v = q.double(), k.double(), v.double()
    kh = k.repeat_interleave(GQA, dim=1).transpose(0, 1)  # [q_heads, t, d]
    vh = v.repeat_interleave(GQA, dim=1).transpose(0, 1)
    s = torch.einsum("hd,htd->ht", q, kh) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("ht,htd->hd", torch.softmax(s, dim=-1), vh), lse


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fill(cache, gen, prompt_lens, steps):
    """Prefills slots 0.. with prompts of `prompt_lens`, then appends `steps` tokens to each;
    returns every slot's K and V on the device."""
    n = len(prompt_lens)
    total = sum(prompt_lens)
    shape = (total, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen, device="cuda").to(cache.dtype)
    v = torch.randn(shape, generator=gen, device="cuda").to(cache.dtype)
    cache.prefill(list(range(n)), prompt_lens, k, v)
    ks, vs, at = [], [], 0
    for t in prompt_lens:
        ks.append([k[at:at + t]])
        vs.append([v[at:at + t]])
        at += t
    slots = torch.arange(n, dtype=torch.int32, device="cuda")
    for _ in range(steps):
        kn = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").to(cache.dtype)
        vn = torch.randn((n, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").to(cache.dtype)
        cache.append(slots, kn, vn)
        for i in range(n):
            ks[i].append(kn[i:i + 1])
            vs[i].append(vn[i:i + 1])
    return [torch.cat(x) for x in ks], [torch.cat(x) for x in vs]


# 2-bit codes of Gaussian data keep a large error (about 0.6 here), so for KIVI-2 the check is
# that each row is much nearer its own slot's attention than any other slot's, which a row read
# from the wrong slot fails (crates/kvq-capi checks KIVI-2 bit for bit against kvq's own cache).
@pytest.mark.parametrize("scheme,dtype,tol", [
    ("fp16", torch.float16, 2e-3),
    ("int8", torch.bfloat16, 2e-2),
    ("kivi2", torch.float16, 0.9),
])
def test_attend_matches_torch_attention(scheme, dtype, tol):
    plan, cache = make(scheme, dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ks, vs = fill(cache, gen, [300, 129, 1], 140)
    assert cache.seq_lens.tolist()[:3] == [440, 269, 141]
    # Rows in another order than the slots, with a padding row.
    order = [2, -1, 0, 1]
    slots = torch.tensor(order, dtype=torch.int32, device="cuda")
    q = torch.randn((4, Q_HEADS, HEAD_DIM), generator=gen, device="cuda").to(dtype)
    out, lse = cache.attend(slots, q)
    torch.cuda.synchronize()
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (4, Q_HEADS)
    for i, s in enumerate(order):
        if s < 0:
            assert torch.all(out[i] == 0)
            continue
        want, want_lse = exact(q[i], ks[s], vs[s])
        err = rel(out[i], want)
        assert err < tol, f"{scheme} row {i} slot {s}: relative error {err:.3e}"
        others = [rel(out[i], exact(q[i], ks[o], vs[o])[0]) for o in range(3) if o != s]
        assert err < 0.75 * min(others), f"{scheme} row {i}: {err:.3f} against {others}"
        if scheme == "fp16":
            assert torch.allclose(lse[i].double(), want_lse, rtol=1e-3, atol=1e-3)


def test_a_verification_step_attends_causally():
    plan, cache = make("fp16", max_q_len=4)
    gen = torch.Generator(device="cuda").manual_seed(4)
    ks, vs = fill(cache, gen, [300, 129, 1], 5)
    # Four draft tokens a sequence, appended and attended in one step each.
    q_len = 4
    kn = torch.randn((3, q_len, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    vn = torch.randn((3, q_len, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    cache.append(torch.arange(3, dtype=torch.int32, device="cuda"), kn, vn)
    order = [2, -1, 0, 1]
    slots = torch.tensor(order, dtype=torch.int32, device="cuda")
    q = torch.randn((4, q_len, Q_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    out, lse = cache.attend(slots, q)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (4, q_len, Q_HEADS)
    for i, s in enumerate(order):
        if s < 0:
            assert torch.all(out[i] == 0)
            continue
        k_all, v_all = torch.cat([ks[s], kn[s]]), torch.cat([vs[s], vn[s]])
        for j in range(q_len):
            seen = ks[s].shape[0] + j + 1  # the tokens before it and itself
            want, want_lse = exact(q[i, j], k_all[:seen], v_all[:seen])
            assert rel(out[i, j], want) < 2e-3, (i, j)
            assert torch.allclose(lse[i, j].double(), want_lse, rtol=1e-3, atol=1e-3), (i, j)
    with pytest.raises(kvq.InvalidArgument, match="max_q_len is 4"):
        cache.attend(slots, torch.zeros((4, 5, Q_HEADS, HEAD_DIM), dtype=torch.float16,
                                        device="cuda"))


def test_a_captured_graph_and_torch_compile_give_the_eager_bits():
    plan, eager = make("kivi2")
    _, graphed = make("kivi2")
    _, compiled = make("kivi2")
    gen = torch.Generator(device="cuda").manual_seed(2)
    for c in (eager, graphed, compiled):
        gen.manual_seed(2)
        fill(c, gen, [200, 50], 0)
    slots = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    kn = torch.zeros((2, KV_HEADS, HEAD_DIM), dtype=torch.float16, device="cuda")
    vn, q = torch.zeros_like(kn), torch.zeros((2, Q_HEADS, HEAD_DIM), dtype=torch.float16,
                                              device="cuda")

    def step(cache):
        cache.append(slots, kn, vn)
        return cache.attend(slots, q)

    # No warm-up run is needed before the capture: make() loaded the kernels (Plan.load).
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step(graphed)
    stepped = torch.compile(step, fullgraph=True)
    for t in range(140):
        kn.copy_(torch.randn(kn.shape, generator=gen, device="cuda"))
        vn.copy_(torch.randn(vn.shape, generator=gen, device="cuda"))
        q.copy_(torch.randn(q.shape, generator=gen, device="cuda"))
        e_out, e_lse = step(eager)
        graph.replay()
        c_out, c_lse = stepped(compiled)
        if t in (0, 77, 139):
            torch.cuda.synchronize()
            assert torch.equal(e_out.view(torch.int16), g_out.view(torch.int16)), t
            assert torch.equal(e_lse.view(torch.int32), g_lse.view(torch.int32)), t
            assert torch.equal(e_out.view(torch.int16), c_out.view(torch.int16)), t
            assert torch.equal(e_lse.view(torch.int32), c_lse.view(torch.int32)), t
    assert eager.seq_lens.tolist()[:2] == graphed.seq_lens.tolist()[:2] == [340, 190]


def test_merged_parts_equal_the_whole():
    plan, cache = make("fp16")
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = 600
    k = torch.randn((t, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    v = torch.randn((t, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    # Slot 0 holds every token; slots 1 and 2 the first 250 and the other 350 (two GPUs' parts).
    cache.prefill([0, 1, 2], [t, 250, t - 250], torch.cat([k, k]), torch.cat([v, v]))
    q = torch.randn((1, Q_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    whole, whole_lse = cache.attend(torch.tensor([0], dtype=torch.int32, device="cuda"), q)
    parts, part_lses = cache.attend(torch.tensor([1, 2], dtype=torch.int32, device="cuda"),
                                    q.expand(2, -1, -1).contiguous())
    out, lse = merge(plan, parts.unsqueeze(1), part_lses.unsqueeze(1))
    torch.cuda.synchronize()
    assert rel(out, whole) < 3e-3
    assert torch.allclose(lse, whole_lse, rtol=1e-4, atol=1e-4)
    # Into the caller's buffers, the same bits; bad shapes are named.
    given = (torch.full_like(out, float("nan")), torch.full_like(lse, float("nan")))
    got = merge(plan, parts.unsqueeze(1), part_lses.unsqueeze(1), out=given[0], lse=given[1])
    torch.cuda.synchronize()
    assert got[0] is given[0] and got[1] is given[1]
    assert torch.equal(given[0].view(torch.int16), out.view(torch.int16))
    assert torch.equal(given[1], lse)
    with pytest.raises(kvq.InvalidArgument, match="lses"):
        merge(plan, parts.unsqueeze(1), part_lses)
    with pytest.raises(kvq.InvalidArgument, match="lse is"):
        merge(plan, parts.unsqueeze(1), part_lses.unsqueeze(1), lse=lse.double())


def test_bad_tensors_are_named():
    plan, cache = make("kivi2")
    slots = torch.tensor([0], dtype=torch.int32, device="cuda")
    q = torch.zeros((1, Q_HEADS, HEAD_DIM), dtype=torch.float16, device="cuda")
    with pytest.raises(kvq.InvalidArgument, match="q is"):
        cache.attend(slots, q.float())
    with pytest.raises(kvq.InvalidArgument, match="slots is"):
        cache.attend(slots.long(), q)
    with pytest.raises(kvq.InvalidArgument, match="k is"):
        cache.append(slots, q, q)
    with pytest.raises(kvq.InvalidArgument, match="more than the plan's max_seqs"):
        cache.attend(torch.zeros(5, dtype=torch.int32, device="cuda"),
                     torch.zeros((5, Q_HEADS, HEAD_DIM), dtype=torch.float16, device="cuda"))
    with pytest.raises(kvq.InvalidArgument, match="slots\\[0\\] = 7"):
        cache.prefill([7], [1], q[:, :KV_HEADS], q[:, :KV_HEADS])
    with pytest.raises(kvq.InvalidArgument, match="q is not contiguous"):
        cache.attend(slots, q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(kvq.InvalidArgument, match="lse is"):
        cache.attend(slots, q, lse=torch.zeros((1, Q_HEADS), device="cuda", dtype=torch.float64))
    with pytest.raises(kvq.InvalidArgument, match="out is"):
        cache.attend(slots, q, out=torch.zeros_like(q).float())


def test_caches_on_one_stream_share_a_workspace():
    """Two caches with one workspace, their calls one after another, give each cache's own
    outputs bit for bit; a workspace too small or of another dtype is refused."""
    plan, own = make("kivi2")
    shared = torch.zeros(plan.workspace_bytes(0), dtype=torch.uint8, device="cuda")
    a, b = PagedCache(plan, "cuda", shared), PagedCache(plan, "cuda", shared)
    gen = torch.Generator(device="cuda").manual_seed(11)
    slots = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    for cache in (own, a, b):
        g = torch.Generator(device="cuda").manual_seed(3)
        fill(cache, g, [700, 300], 0)
    q = torch.randn((2, Q_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    want, _ = own.attend(slots, q)
    got_a, _ = a.attend(slots, q)
    got_b, _ = b.attend(slots, q)
    assert torch.equal(got_a, want) and torch.equal(got_b, want)
    with pytest.raises(kvq.InvalidArgument, match="workspace is"):
        PagedCache(plan, "cuda", shared[:1])
    with pytest.raises(kvq.InvalidArgument, match="workspace is"):
        PagedCache(plan, "cuda", shared.float())


def test_attend_writes_into_the_callers_buffers():
    plan, cache = make("kivi2")
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn((700, KV_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    cache.prefill([0, 1], [300, 400], k, k.flip(0))
    slots = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    q = torch.randn((2, Q_HEADS, HEAD_DIM), generator=gen, device="cuda").half()
    fresh, fresh_lse = cache.attend(slots, q)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, Q_HEADS), float("nan"), device="cuda")
    got, got_lse = cache.attend(slots, q, out=out, lse=lse)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    assert torch.equal(out.view(torch.int16), fresh.view(torch.int16))
    assert torch.equal(lse, fresh_lse)


def rope(x, start, theta):
    """LLaMA's half-split RoPE of ``x`` ([t, heads, d] float32) at positions start.., in float64."""
    t, d = x.shape[0], x.shape[-1]
    half = d // 2
    pos = torch.arange(start, start + t, dtype=torch.float64, device=x.device)[:, None]
    inv = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / d)
    ang = pos * inv
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * c - b * s, a * s + b * c], -1).float()


def host_bytes(t):
    return t.float().contiguous().cpu().numpy().tobytes()


def test_a_codebook_plan_prefills_appends_and_attends_as_the_reference(tmp_path):
    """CommVQ-1 through PagedCache: codebooks trained by the CPU reference and loaded from a file,
    prompts and appends with the keys before and after RoPE (slots out of order, a padding row),
    then attention against the CPU reference coding the same tokens with the same codebooks; a
    NaN value is refused and reported by check()."""
    theta = 10000.0
    limits = dict(head_dim=HEAD_DIM, q_heads=Q_HEADS, kv_heads=KV_HEADS, max_seqs=4,
                  max_seq_len=512, rope_theta=theta)
    with pytest.raises(kvq.InvalidArgument, match="rope_theta"):
        kvq.Plan("commvq1", pool_pages=64, **{**limits, "rope_theta": 0.0})
    pages = kvq.Plan("commvq1", pool_pages=1, **limits).max_pages_per_seq
    plan = kvq.Plan("commvq1", pool_pages=4 * pages, **limits)
    assert plan.takes_pre_rope_keys and plan.rope_theta == theta
    cache = PagedCache(plan, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)

    def rand(*shape):
        return torch.randn(shape, generator=gen, device="cuda").half()

    cal_k, cal_v = rand(512, KV_HEADS, HEAD_DIM), rand(512, KV_HEADS, HEAD_DIM)
    books = kvq._kvq._reference_codebooks(plan, 512, host_bytes(cal_k), host_bytes(cal_v), 7)
    path = tmp_path / "layer0.safetensors"
    path.write_bytes(books)
    cache.load_codebooks(str(path))
    with pytest.raises(kvq.InvalidArgument, match="codebook file"):
        cache.load_codebooks(books[: len(books) // 2])

    prompts, steps, slots_of = [200, 0], 180, [3, 1]
    total = [p + steps for p in prompts]
    k_pre = [rand(t, KV_HEADS, HEAD_DIM) for t in total]
    k_post = [rope(k.float(), 0, theta).half() for k in k_pre]
    v = [rand(t, KV_HEADS, HEAD_DIM) for t in total]
    with pytest.raises(kvq.InvalidArgument, match="k_pre_rope"):
        cache.prefill(slots_of, prompts, torch.cat([k[:p] for k, p in zip(k_post, prompts)]),
                      torch.cat([x[:p] for x, p in zip(v, prompts)]))
    cache.prefill(slots_of, prompts, torch.cat([k[:p] for k, p in zip(k_post, prompts)]),
                  torch.cat([x[:p] for x, p in zip(v, prompts)]),
                  k_pre_rope=torch.cat([k[:p] for k, p in zip(k_pre, prompts)]))
    # Rows: sequence 1, padding (NaN, never read), sequence 0.
    slots = torch.tensor([slots_of[1], -1, slots_of[0]], dtype=torch.int32, device="cuda")
    nan = torch.full((KV_HEADS, HEAD_DIM), float("nan"), device="cuda").half()
    for s in range(steps):
        row = lambda xs: torch.stack([xs[1][prompts[1] + s], nan, xs[0][prompts[0] + s]])
        cache.append(slots, row(k_post), row(v), k_pre_rope=row(k_pre))
    cache.check()
    assert cache.seq_lens[slots_of[0]].item() == total[0]
    assert cache.seq_lens[slots_of[1]].item() == total[1]

    q = rand(3, Q_HEADS, HEAD_DIM)
    out, lse = cache.attend(slots, q)
    assert torch.all(out[1] == 0) and torch.isfinite(lse[0]).all() and torch.isfinite(lse[2]).all()
    for row, seq in [(0, 1), (2, 0)]:
        want = kvq._kvq._reference_codebook_attend(
            plan, books, total[seq], host_bytes(k_pre[seq]), host_bytes(k_post[seq]),
            host_bytes(v[seq]), host_bytes(q[row]))
        want = torch.frombuffer(bytearray(want), dtype=torch.float32).view(Q_HEADS, HEAD_DIM)
        got = out[row].float().cpu()
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item(), row

    # A NaN key is refused: the slot keeps its length until check() reports it.
    bad = rand(3, KV_HEADS, HEAD_DIM)
    bad[0, 0, 5] = float("nan")
    cache.append(slots, bad, rand(3, KV_HEADS, HEAD_DIM), k_pre_rope=rand(3, KV_HEADS, HEAD_DIM))
    with pytest.raises(kvq.InvalidArgument, match="NaN"):
        cache.check()
    assert cache.seq_lens[slots_of[1]].item() == total[1]
    assert cache.seq_lens[slots_of[0]].item() == total[0] + 1
    cache.check()


def test_an_xquant_plan_prefills_appends_and_attends_as_the_reference(tmp_path):
    """XQuant-2 through PagedCache: projections made from random W_k, W_v by
    kvq.engine.xquant_projections and loaded from a file, prompts' and steps' layer input X
    (slots out of order, a NaN padding row, one step through the torch custom op), then attention
    against the CPU reference caching the same X with the same projections."""
    theta, d_model = 10000.0, 256
    limits = dict(head_dim=HEAD_DIM, q_heads=Q_HEADS, kv_heads=KV_HEADS, max_seqs=4,
                  max_seq_len=512, rope_theta=theta)
    with pytest.raises(kvq.InvalidArgument, match="d_model"):
        kvq.Plan("xquant2", pool_pages=64, **limits)
    pages = kvq.Plan("xquant2", pool_pages=1, d_model=d_model, **limits).max_pages_per_seq
    plan = kvq.Plan("xquant2", pool_pages=4 * pages, d_model=d_model, **limits)
    assert plan.takes_layer_input and plan.d_model == d_model
    assert not kvq.Plan("kivi2", pool_pages=1, **limits).takes_layer_input
    cache = PagedCache(plan, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).half()

    out_width = KV_HEADS * HEAD_DIM
    w_k, w_v = rand(d_model, out_width, scale=d_model ** -0.5), rand(d_model, out_width,
                                                                    scale=d_model ** -0.5)
    with pytest.raises(kvq.InvalidArgument, match="d_model"):
        kvq.engine.xquant_projections("xquant2", w_k[:, :10], w_v, kv_heads=KV_HEADS,
                                      head_dim=HEAD_DIM)
    proj = kvq.engine.xquant_projections("xquant2", w_k, w_v, kv_heads=KV_HEADS,
                                         head_dim=HEAD_DIM)
    path = tmp_path / "layer0.safetensors"
    path.write_bytes(proj)
    cache.load_projections(str(path))
    with pytest.raises(kvq.InvalidArgument, match="projection file"):
        cache.load_projections(proj[: len(proj) // 2])

    prompts, steps, slots_of = [200, 0], 180, [3, 1]
    total = [p + steps for p in prompts]
    x = [rand(t, d_model) for t in total]
    with pytest.raises(kvq.InvalidArgument, match="prefill_x"):
        cache.prefill(slots_of, prompts, rand(200, KV_HEADS, HEAD_DIM), rand(200, KV_HEADS, HEAD_DIM))
    cache.prefill_x(slots_of, prompts, torch.cat([a[:p] for a, p in zip(x, prompts)]))
    # Rows: sequence 1, padding (NaN, never stored), sequence 0.
    slots = torch.tensor([slots_of[1], -1, slots_of[0]], dtype=torch.int32, device="cuda")
    nan = torch.full((d_model,), float("nan"), device="cuda").half()
    for s in range(steps):
        row = torch.stack([x[1][prompts[1] + s], nan, x[0][prompts[0] + s]])
        if s == steps // 2:
            torch.ops.kvq.xquant_append(cache._id, *cache._buffers(), slots, row, cache.workspace)
        else:
            cache.append_x(slots, row)
    assert cache.seq_lens[slots_of[0]].item() == total[0]
    assert cache.seq_lens[slots_of[1]].item() == total[1]

    q = rand(3, Q_HEADS, HEAD_DIM)
    out, lse = cache.attend(slots, q)
    assert torch.all(out[1] == 0) and torch.isfinite(lse[0]).all() and torch.isfinite(lse[2]).all()
    for row, seq in [(0, 1), (2, 0)]:
        want = kvq._kvq._reference_xquant_attend(plan, proj, total[seq], host_bytes(x[seq]),
                                                 host_bytes(q[row]))
        want = torch.frombuffer(bytearray(want), dtype=torch.float32).view(Q_HEADS, HEAD_DIM)
        got = out[row].float().cpu()
        assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item(), row


def test_an_xquant_cl_stack_carries_its_accumulator_as_the_reference():
    """XQuant-CL-2 over three layers through PagedCache: each layer's writes take the accumulator
    X̂ the stack carries (zeros before the first layer) and replace it, prompts and steps (slots
    out of order, a NaN padding row, one step through the torch custom op), then each layer's
    attention against the CPU reference of the same stack."""
    theta, d_model, depth = 10000.0, 384, 3
    limits = dict(head_dim=HEAD_DIM, q_heads=Q_HEADS, kv_heads=KV_HEADS, max_seqs=4,
                  max_seq_len=512, rope_theta=theta, d_model=d_model)
    pages = kvq.Plan("xquant-cl2", pool_pages=1, **limits).max_pages_per_seq
    plan = kvq.Plan("xquant-cl2", pool_pages=4 * pages, **limits)
    assert plan.takes_layer_input and plan.takes_accumulator
    assert not kvq.Plan("xquant2", pool_pages=1, **limits).takes_accumulator
    workspace = torch.zeros(plan.workspace_bytes(torch.cuda.current_device()), dtype=torch.uint8,
                            device="cuda")
    caches = [PagedCache(plan, "cuda", workspace=workspace) for _ in range(depth)]
    gen = torch.Generator(device="cuda").manual_seed(23)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).half()

    out_width = KV_HEADS * HEAD_DIM
    projs = []
    for cache in caches:
        w_k, w_v = (rand(d_model, out_width, scale=d_model ** -0.5) for _ in range(2))
        projs.append(kvq.engine.xquant_projections("xquant-cl2", w_k, w_v, kv_heads=KV_HEADS,
                                                   head_dim=HEAD_DIM))
        cache.load_projections(projs[-1])

    prompts, steps, slots_of = [150, 0], 140, [3, 1]
    total = [p + steps for p in prompts]
    x = [[rand(t, d_model) for t in total] for _ in range(depth)]  # x[layer][sequence]
    one = rand(1, d_model)
    with pytest.raises(kvq.InvalidArgument, match="pass x_hat"):
        caches[0].append_x(torch.tensor([0], dtype=torch.int32, device="cuda"), one)
    with pytest.raises(kvq.InvalidArgument, match="x_hat is"):
        caches[0].append_x(torch.tensor([0], dtype=torch.int32, device="cuda"), one,
                           x_hat=rand(2, d_model))
    assert caches[0].seq_lens.sum().item() == 0

    x_hat = torch.zeros(sum(prompts), d_model, dtype=torch.float16, device="cuda")
    for layer, cache in enumerate(caches):
        cache.prefill_x(slots_of, prompts, torch.cat([a[:p] for a, p in zip(x[layer], prompts)]),
                        x_hat=x_hat)
    # Rows: sequence 1, padding (NaN, never stored), sequence 0.
    slots = torch.tensor([slots_of[1], -1, slots_of[0]], dtype=torch.int32, device="cuda")
    nan = torch.full((d_model,), float("nan"), device="cuda").half()
    for s in range(steps):
        x_hat = torch.zeros(3, d_model, dtype=torch.float16, device="cuda")
        for layer, cache in enumerate(caches):
            row = torch.stack([x[layer][1][prompts[1] + s], nan, x[layer][0][prompts[0] + s]])
            if s == steps // 2:
                torch.ops.kvq.xquant_append_cross_layer(cache._id, *cache._buffers(), slots, row,
                                                        x_hat, cache.workspace)
            else:
                cache.append_x(slots, row, x_hat=x_hat)
        assert torch.isfinite(x_hat[0]).all() and torch.isfinite(x_hat[2]).all()
    for cache in caches:
        assert cache.seq_lens[slots_of[0]].item() == total[0]
        assert cache.seq_lens[slots_of[1]].item() == total[1]

    q = [rand(3, Q_HEADS, HEAD_DIM) for _ in range(depth)]
    outs = [cache.attend(slots, q[layer])[0] for layer, cache in enumerate(caches)]
    # The reference projects in f64 where the GPU sums f32 products: a latent next to a 2-bit
    # code boundary can take the other code, which moves an output by a few thousandths. A row
    # read from another layer or slot is off by the output's own size.
    errors = {}
    for row, seq in [(0, 1), (2, 0)]:
        want = kvq._kvq._reference_xquant_cross_layer_attend(
            plan, projs, total[seq], [host_bytes(x[layer][seq]) for layer in range(depth)],
            [host_bytes(q[layer][row]) for layer in range(depth)])
        want = [torch.frombuffer(bytearray(w), dtype=torch.float32).view(Q_HEADS, HEAD_DIM)
                for w in want]
        for layer in range(depth):
            assert torch.all(outs[layer][1] == 0)
            got = outs[layer][row].float().cpu()
            top = want[layer].abs().max().item()
            errors[(row, layer)] = (got - want[layer]).abs().max().item() / top
            for other in range(depth):
                if other != layer:
                    assert (got - want[other]).abs().max().item() > 0.3 * top, (row, layer, other)
    assert max(errors.values()) <= 5e-2, errors
