"""Plans from Python: the same sizes and refusals as the C ABI, as typed exceptions."""

import threading

import pytest

import kvq

LIMITS = dict(head_dim=128, q_heads=32, kv_heads=8, max_seqs=16, max_seq_len=32768,
              pool_pages=4096)


def test_a_builtin_plans_its_buffers():
    plan = kvq.Plan("kivi2", **LIMITS)
    assert plan.page_tokens == 128
    assert plan.dtype == "float16"
    names = [b.name for b in plan.buffers]
    assert names == ["k_pool", "v_pool", "k_sink", "v_sink", "k_tail", "v_tail", "seq_lens",
                     "page_table", "k_pending", "v_pending", "status", "codebooks", "xquant_weights",
                     "xquant_accumulator"]
    assert sum(b.nbytes for b in plan.buffers) == plan.total_bytes
    assert all(b.alignment == 256 for b in plan.buffers)
    pools = sum(b.nbytes for b in plan.buffers if b.name.endswith("_pool"))
    assert pools == plan.page_bytes * LIMITS["pool_pages"]
    tables = {b.name: b.nbytes for b in plan.buffers}
    assert tables["seq_lens"] == 4 * LIMITS["max_seqs"]
    assert tables["page_table"] == 4 * LIMITS["max_seqs"] * plan.max_pages_per_seq
    fp16 = plan.total_bytes - pools - tables["seq_lens"] - tables["page_table"]
    assert fp16 == plan.state_bytes_per_seq * LIMITS["max_seqs"]
    # KIVI-2 keeps a page of 128 tokens x 8 heads x 128 channels of K and V in about an eighth
    # of FP16's bytes, plus scales.
    fp16_page = 2 * 128 * 8 * 128 * 2
    assert fp16_page / 8 < plan.page_bytes < fp16_page / 6
    assert "int(bits = 2, axis = channel)" in plan.scheme
    assert "kivi2" not in repr(plan) and "head_dim=128" in repr(plan)


def test_scheme_text_and_torch_style_dtypes():
    plan = kvq.Plan("k = int(4, channel), v = int(2, token), sink = 8", dtype="torch.bfloat16",
                    **LIMITS)
    assert plan.dtype == "bfloat16"
    assert plan.sink_tokens == 8
    for name in ("f16", "half", "float16"):
        assert kvq.Plan("int8", dtype=name, **LIMITS).dtype == "float16"
    with pytest.raises(kvq.InvalidArgument, match="float32"):
        kvq.Plan("kivi2", dtype="float32", **LIMITS)


def test_fewer_tokens_need_a_narrower_page_table():
    long = kvq.Plan("kivi4", **LIMITS)
    short = kvq.Plan("kivi4", **{**LIMITS, "max_seq_len": 4096})
    assert short.max_pages_per_seq < long.max_pages_per_seq
    assert short.page_bytes == long.page_bytes


def test_errors_are_typed_and_say_what_to_change():
    with pytest.raises(kvq.InvalidScheme, match="kitty"):
        kvq.Plan("kivi9", **LIMITS)
    with pytest.raises(kvq.InvalidScheme, match="tokn"):
        kvq.Plan("k = int(2, channel), v = int(2, tokn)", **LIMITS)
    with pytest.raises(kvq.UnsupportedShape, match="head_dim"):
        kvq.Plan("kivi2", **{**LIMITS, "head_dim": 100})
    with pytest.raises(kvq.InvalidArgument, match="not a multiple of limits.kv_heads"):
        kvq.Plan("kivi2", **{**LIMITS, "kv_heads": 5})
    with pytest.raises(kvq.InvalidArgument, match="max_seqs"):
        kvq.Plan("kivi2", **{**LIMITS, "max_seqs": 0})
    with pytest.raises(kvq.InvalidArgument, match="pool_pages = -1"):
        kvq.Plan("kivi2", **{**LIMITS, "pool_pages": -1})
    for error in (kvq.InvalidArgument, kvq.InvalidScheme, kvq.UnsupportedScheme,
                  kvq.UnsupportedShape, kvq.CudaError, kvq.CompileError, kvq.InternalError):
        assert issubclass(error, kvq.KvqError)


def test_schemes_without_kernels_are_unsupported_schemes():
    # Every built-in scheme has kernels on the engine surface; a calibrated latent scheme has none.
    assert all(gpu for _, gpu in kvq.builtin_schemes())
    assert {"fp16", "kivi2", "kitty", "xquant2", "xquant-cl2"} <= {n for n, _ in kvq.builtin_schemes()}
    with pytest.raises(kvq.UnsupportedScheme, match="no GPU kernel"):
        kvq.Plan("k = int(2, channel), v = int(2, channel), "
                 "calibrate = calibrate(tau1 = -1.5, tau2 = 3.25), source = x(latent)",
                 **{**LIMITS, "rope_theta": 500000.0, "d_model": 4096})


def test_keyword_limits_are_required():
    with pytest.raises(TypeError):
        kvq.Plan("kivi2", 128, 32, 8, 16, 32768, 4096)  # limits are keyword-only
    with pytest.raises(TypeError):
        kvq.Plan("kivi2", head_dim=128)


def test_a_plan_is_shared_between_threads():
    plan = kvq.Plan("kitty", **LIMITS)
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(plan.total_bytes)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [plan.total_bytes] * 4


def test_codebook_plans_need_the_rope_base_and_list_their_own_buffers():
    with pytest.raises(kvq.InvalidArgument, match="rope_theta"):
        kvq.Plan("commvq1", **LIMITS)
    with pytest.raises(kvq.UnsupportedShape, match="max_q_len"):
        kvq.Plan("commvq1", rope_theta=500000.0, max_q_len=2, **LIMITS)
    plan = kvq.Plan("commvq1", rope_theta=500000.0, **LIMITS)
    sizes = {b.name: b.nbytes for b in plan.buffers}
    assert sizes["codebooks"] > 0 and sizes["status"] == 16 * 16
    assert sizes["k_pending"] == sizes["k_tail"] > 0
    # An integer plan has none of them.
    kivi = {b.name: b.nbytes for b in kvq.Plan("kivi2", **LIMITS).buffers}
    assert [kivi[n] for n in ("k_pending", "v_pending", "status", "codebooks")] == [0, 0, 0, 0]


def test_xquant_plans_need_d_model_and_the_rope_base_and_list_their_weights():
    with pytest.raises(kvq.InvalidArgument, match="d_model"):
        kvq.Plan("xquant2", rope_theta=500000.0, **LIMITS)
    with pytest.raises(kvq.InvalidArgument, match="rope_theta"):
        kvq.Plan("xquant2", d_model=4096, **LIMITS)
    with pytest.raises(kvq.InvalidArgument, match="d_model"):
        kvq.Plan("xquant2", d_model=-1, rope_theta=500000.0, **LIMITS)
    plan = kvq.Plan("xquant2", d_model=4096, rope_theta=500000.0, **LIMITS)
    assert plan.takes_layer_input and plan.d_model == 4096
    sizes = {b.name: b.nbytes for b in plan.buffers}
    # up_k (two halves and the K groups) and up_v of 1,024 latents × 1,024 columns, down's
    # two halves of 4,096 × 2,048: at least 8 MiB + 32 MiB.
    assert sizes["xquant_weights"] >= (8 + 32) << 20
    assert [sizes[n] for n in ("k_pending", "v_pending", "status", "codebooks")] == [0, 0, 0, 0]
    # The latents of 8 × 128 keys and values in XQuant-2 take KIVI-2's page bytes, near enough.
    kivi = kvq.Plan("kivi2", **LIMITS)
    assert abs(plan.page_bytes - kivi.page_bytes) <= kivi.page_bytes // 8
    assert kivi.buffers[-2].name == "xquant_weights" and kivi.buffers[-2].nbytes == 0
    assert sizes["xquant_accumulator"] == 0 and not plan.takes_accumulator
    # XQuant-CL adds the accumulator's latents (f16 K and V of every token slot) and the lift
    # matrix (f32 [2·1,024][4,096]).
    cl = kvq.Plan("xquant-cl2", d_model=4096, rope_theta=500000.0, **LIMITS)
    cl_sizes = {b.name: b.nbytes for b in cl.buffers}
    assert cl.takes_accumulator
    assert cl_sizes["xquant_accumulator"] == 2 * LIMITS["max_seqs"] * LIMITS["max_seq_len"] * 1024 * 2
    assert cl_sizes["xquant_weights"] - sizes["xquant_weights"] == 4 * 2 * 1024 * 4096
