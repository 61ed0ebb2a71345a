#pragma once
// Split-K decode attention over an XQuant latent cache (docs/CODEBOOKS.md §3): the cache holds
// the layer input's latents X·down_k and X·down_v in the integer store of docs/LAYOUT.md (one
// row of R channels is XH store heads of XW: KTensor, VTensor at width XW, FP16 sink and tail rows
// of latents), and the
// kernel rebuilds K = RoPE(L̂_k·up_k) per tile of tokens for each of its KV_PER_CTA KV heads,
// scores each KV head's GQA query heads against it, and never rebuilds V: it accumulates
// Σ_t p_t·l̂_v,t over the latent and multiplies by up_v once per split. Grid (num_splits,
// kv_heads / KV_PER_CTA, rows), block THREADS (eight compute warps, after the producer warpgroup
// on the warpgroup path); writes each split's unnormalised output and (m, l) for kvq/combine.cuh.
//
// K's rebuild is a GEMM of the tile's XQ_M tokens × R latents by up_k's R × D slice on tensor
// cores, f32 accumulators in registers: on Hopper's warpgroup MMAs (KVQ_XQ_WGMMA below,
// kvq/xquant/warpgroup.cuh), or on mma m16n8k16, where the R dimension streams through a
// two-stage shared-memory pipeline in chunks of XQ_KC channels: up_k's chunk by cp.async, the
// latents' chunk loaded into registers while the previous chunk multiplies, then dequantized
// (fma(scale, code, zero) in f32, as the reference) and stored as f16. PASSES = 3 splits both
// operands into f16 halves, x = hi + lo, and sums hi·hi + hi·lo + lo·hi, which keeps the product
// to about f32's precision; PASSES = 1 multiplies the f16 roundings once (CODEBOOKS.md §3.1 on
// the error and the cost). Warps tile the product XQ_WM × XQ_WN; each warp holds its columns j
// and j + D/2 together, so RoPE rotates in registers, and the scores reduce across lanes and the
// XQ_WN column warps.
//
// The including unit defines (kvq/common.cuh, kvq/io.cuh, kvq/tensor.cuh, kvq/decode_common.cuh
// and kvq/decode/helpers.cuh first): IO, D (head_dim of K, V and the queries), XR (the latent
// width R), XW (the store's head width, dividing XR), GQA, THREADS, TILE (tokens a tile: 128, or
// 64 past head_dim 128), PAGE, SINK, PASSES, KV_PER_CTA (KV heads a CTA: 2 on the warpgroup path
// where kvq-codegen pairs them, else 1), TENSOR_V (V's sums on tensor cores,
// kvq/xquant/values.cuh), CROSS_LAYER (XQuant-CL: the stored
// latents are deltas, and base_k, base_v hold the accumulator's latents, f16 [slot][base_rows][XR],
// added to them), SMEM_BYTES (the launch's dynamic shared memory), KVQ_XQ_WGMMA and WG_STAGES
// (the warpgroup path and its ring's stages), and KTensor, VTensor (kvq/tensor.cuh's traits at
// width XW).
//
// KVQ_XQ_WGMMA (sm_90a, one-pass product, head_dim ≤ 128, 2- to 4-bit channel-axis K latents;
// kvq-codegen's RebuildMma): K's rebuild runs on warpgroup MMAs whose A operand the eight compute
// warps (threads XQ_PRODUCERS on) decode into registers, fed up_k by one producer warpgroup
// (kvq/xquant/warpgroup.cuh), whose other three warps set up each pass (the page's K table, V's
// scales and code rows); the same compute warps then score (kvq/xquant/scores.cuh), sum V and
// keep the softmax, each compute warpgroup on its own tiles of 64 rows in turn with the other. Otherwise every warp copies,
// decodes and multiplies on mma.sync through a two-stage pipeline.
#ifndef KVQ_XQ_WGMMA
#define KVQ_XQ_WGMMA 0
#endif
static constexpr bool WGMMA = KVQ_XQ_WGMMA;
static constexpr int XQ_PRODUCERS = WGMMA ? 128 : 0;                 // the producer warpgroup's threads
static constexpr int XQ_SETUP_THREADS = WGMMA ? 96 : 0;              // its last three warps: each pass's set-up
static constexpr int XQ_CT = THREADS - XQ_PRODUCERS;                 // compute threads
// A compute thread's index (negative in the producer warpgroup).
static __device__ __forceinline__ int xq_ct() { return (int)threadIdx.x - XQ_PRODUCERS; }
static_assert(XQ_CT == 256, "eight compute warps");
// KV heads a CTA, and their query heads. The latents belong to the token, not to a KV head, so a
// CTA of two KV heads decodes each tile's K and V codes once for both: K's rebuild multiplies the
// same A fragments by both heads' up_k slices, and V's sums take both heads' query heads as the
// MMA's columns. That halves a head's loads and decoding of the codes, which at one head a CTA
// took as long as the MMAs.
static constexpr int XQ_KH = KV_PER_CTA;
static constexpr int XQ_QH = XQ_KH * GQA;
static_assert(XQ_KH == 1 || (XQ_KH == 2 && WGMMA), "two KV heads a CTA on the warpgroup path only");
static_assert(TILE == (D <= 128 ? 128 : 64), "the warp tiling's rows (kvq-codegen's xquant_tile)");
static_assert(D % 32 == 0 && D <= 256, "head_dim: a multiple of 32, at most 256");
static_assert(GQA >= 1 && XQ_QH <= 8, "at most eight query heads a CTA (s_alpha, V's n8 columns)");
static_assert(PASSES == 1 || PASSES == 3, "one f16 product or three split ones");
static_assert(!WGMMA || (PASSES == 1 && !CROSS_LAYER), "warpgroup MMAs take the one-pass product of plain latents");

// Tile groups: the warps that share a tile, its scores, softmax state and V sums. On the
// warpgroup path each consumer warpgroup is a group that walks its own tiles of TILE / 2 rows
// (ping-pong: one group's tail runs while the other's MMAs keep the tensor cores busy), and the
// two groups' states merge once at the split's end; on mma.sync all eight warps share a tile.
static constexpr int XQ_GROUPS = WGMMA ? 2 : 1;
static constexpr int XQ_GT = XQ_CT / XQ_GROUPS;                      // threads a group
static constexpr int XQ_GW = XQ_GT / 32;                             // warps a group
static constexpr int XQ_M = TILE / XQ_GROUPS;                        // tokens a group's tile
// Latent channels a pipeline chunk: 64 where the store heads allow (and, on mma.sync, for the
// one-pass product of 2-, 4- or 8-bit codes: two f16 parts of 64 would not fit beside the V
// rows; on the warpgroup path at one KV head a CTA: at two, a chunk of 32 takes both heads'
// up_k and keeps the registers of two heads' accumulators in bounds), else 32; a chunk lies in
// one store head.
static constexpr int XQ_KC =
    XW % 64 == 0 && ((WGMMA && XQ_KH == 1) || (!WGMMA && PASSES == 1 && KTensor::BITS != 3)) ? 64 : 32;
static constexpr int XQ_CHUNKS = XR / XQ_KC;                           // chunks of the latent a tile
static constexpr int XQ_WN = WGMMA || D <= 96 ? 1 : (D <= 224 ? 2 : 4); // warps across K's columns
static constexpr int XQ_WM = XQ_GW / XQ_WN;                          // warps across the tile's tokens
static constexpr int XQ_MT = XQ_M / (16 * XQ_WM);                    // 16-row mma tiles a warp
static constexpr int XQ_HC = D / (2 * XQ_WN);                        // a warp's columns in each RoPE half
static constexpr int XQ_NH = XQ_HC / 8;                              // 8-column mma tiles a warp a half
static constexpr int XQ_NT = 2 * XQ_NH;
static constexpr int XQ_LD = XQ_KC + 8;                              // staged row stride in halves: banks apart
// A thread's latent channels of a row a chunk on the mma.sync path, and threads a staged row
// (the warpgroup path decodes its own fragments; unused there).
static constexpr int XQ_APT = WGMMA ? 0 : XQ_M * XQ_KC / THREADS;
static constexpr int XQ_TPR = WGMMA ? 0 : XQ_KC / XQ_APT;
static constexpr int XQ_PARTS = PASSES == 3 ? 2 : 1;                 // f16 halves an operand
static constexpr int XQ_A_HALVES = XQ_M * XQ_LD, XQ_B_HALVES = D * XQ_LD;
static constexpr int XQ_STAGE_HALVES = XQ_PARTS * (XQ_A_HALVES + XQ_B_HALVES);
static constexpr int XQ_STAGE_BYTES = XQ_STAGE_HALVES * 2;
static constexpr int XQ_B_OFFSET = XQ_PARTS * XQ_A_HALVES * 2;       // bytes into a stage
static constexpr int XQ_STAGES = WGMMA ? WG_STAGES : 2;     // WG_STAGES: kvq-codegen's, by the room left
static_assert(XQ_STAGES >= 2 && XQ_STAGES <= 8, "a ring of two to eight stages (kvq-codegen picks up to four)");
static constexpr int XQ_VQ = 4;                                      // consecutive V latents a thread sums (CUDA cores)
static constexpr int XQ_V_ROWS_BYTES = TENSOR_V ? TILE * (XR * VTensor::BITS / 8 + 16) : 0; // every group's rows
static_assert(XR % XQ_KC == 0 && XW % XQ_KC == 0, "latents in whole pipeline chunks");
static_assert(XQ_MT >= 1 && XQ_MT * 16 * XQ_WM == XQ_M && XQ_HC % 8 == 0, "the warp tiling covers the tile");
static_assert(WGMMA || XQ_APT == 8 || XQ_APT == 16 || XQ_APT == 32, "a thread stages 8, 16 or 32 channels of a row");
static_assert(KTensor::BITS >= 1 && VTensor::BITS >= 1 && !KTensor::BOOST && !VTensor::BOOST, "integer latents");

static constexpr int XQ_TVH_MAX = 4;                                 // store heads the tensor-core V path takes
static constexpr int XQ_TVH = TENSOR_V ? XR / XW : 1;                 // V scales and zeros a row, tensor path
static constexpr int XQ_OPARTS = XQ_CT / (D / 4);                    // latent parts of the split's output
// A query head's row of the latent sums, in floats: four past the latent, so the tensor path's
// merge, whose lanes write query heads 2tq, 2tq + 1 of channels g and g + 8, meets 32 banks.
static constexpr int XQ_VSLD = XR + 4;

#include "kvq/xquant/latents.cuh"
#include "kvq/xquant/rebuild.cuh"
#include "kvq/xquant/values.cuh"
#if KVQ_XQ_WGMMA
#include "kvq/hopper.cuh"
#include "kvq/xquant/warpgroup.cuh"
#include "kvq/xquant/scores.cuh"
static constexpr int XQ_STAGES_BYTES = XQ_STAGES * XQ_WG_STAGE_BYTES;
#else
static constexpr int XQ_STAGES_BYTES = XQ_STAGES * XQ_STAGE_BYTES;
static constexpr int XQ_KTAB_BYTES = 0;
#endif
static_assert(XQ_STAGES_BYTES >= XQ_OPARTS * XQ_QH * D * 4, "the output's parts fit the pipeline's stages");
static_assert(SMEM_BYTES == XQ_STAGES_BYTES + XQ_V_ROWS_BYTES + XQ_GROUPS * (XQ_QH * XQ_VSLD * 4 + XQ_KTAB_BYTES),
              "dynamic shared memory (kvq-codegen's xquant.rs)");

static __device__ __forceinline__ void kvq_xquant_decode(
    const kvq_u16* __restrict__ q, const kvq_u8* __restrict__ k_pool, const kvq_u8* __restrict__ v_pool,
    const kvq_i32* __restrict__ page_table, int max_pages, const kvq_u16* __restrict__ k_sink,
    const kvq_u16* __restrict__ v_sink, const kvq_u16* __restrict__ k_tail, const kvq_u16* __restrict__ v_tail,
    const kvq_i32* __restrict__ seq_lens, const kvq_i32* __restrict__ seq_slots, const kvq_u16* __restrict__ up_k_hi,
    const kvq_u16* __restrict__ up_k_lo, const kvq_u16* __restrict__ up_k_groups, const float* __restrict__ up_v,
    const double* __restrict__ rope_freq,
    const kvq_u16* __restrict__ base_k, const kvq_u16* __restrict__ base_v, int base_rows, float* __restrict__ part_acc,
    float* __restrict__ part_ml)
{
    // Dynamic shared memory: the rebuild's stages, the tile's V code rows (tensor path), each
    // group's latent sums [XQ_QH][XR] (CUDA-core path, and the whole sums at the end), each group's
    // table of its page's K scales and zeros (warpgroup path).
    extern __shared__ __align__(128) kvq_u8 xq_smem[];
    kvq_u16* const stages = (kvq_u16*)xq_smem;
    kvq_u8* const s_v_all = xq_smem + XQ_STAGES_BYTES;
    float* const s_vsum_all = (float*)(xq_smem + XQ_STAGES_BYTES + XQ_V_ROWS_BYTES);
    kvq_u32* const s_ktab_all = (kvq_u32*)(xq_smem + XQ_STAGES_BYTES + XQ_V_ROWS_BYTES + XQ_GROUPS * XQ_QH * XQ_VSLD * 4);
#if KVQ_XQ_WGMMA
    // The queries as the scores' B fragments (kvq/xquant/scores.cuh).
    __shared__ __align__(16) float2 s_qf[XQ_QFRAG];
#else
    __shared__ __align__(16) float s_q[XQ_QH * D];
#endif
    __shared__ float s_sp[XQ_GROUPS][XQ_WN][XQ_QH][XQ_M];
    __shared__ __align__(16) float s_vs[XQ_GROUPS][XQ_TVH][XQ_M], s_vz[XQ_GROUPS][XQ_TVH][XQ_M];
    __shared__ __align__(16) kvq_u16 s_w[XQ_GROUPS][XQ_TVH * XQ_WPART];
    __shared__ XqLoc s_vloc[XQ_GROUPS][XQ_M];
    __shared__ float s_m[XQ_GROUPS][XQ_QH], s_l[XQ_GROUPS][XQ_QH], s_z[XQ_GROUPS][XQ_QH][XQ_TVH], s_alpha[XQ_GROUPS][8];
    // RoPE's frequencies (read every tile: shared memory's latency, not a global load's) and the
    // turn of eight rows.
    __shared__ double s_rope_freq[D / 2];
    __shared__ float2 s_rope_step[D / 2];
    // The warpgroup path's stage barriers: `full` [0, XQ_STAGES), then `empty`.
    __shared__ __align__(8) unsigned long long s_bar[2 * XQ_STAGES];
    // The warpgroup path's passes in order: phase p completes once pass p has waited for its last
    // chunk, that is, once every chunk of its last XQ_STAGES steps is in.
    __shared__ __align__(8) unsigned long long s_pass_bar;
    // The warpgroup path's set-up of each group's passes by the producer warpgroup's set-up warps
    // (below): `ktab_full` once the page's K table is built, `ktab_free` once the group's decode
    // has read it; `v_full` once the V rows' scales and zeros are written and their code rows
    // copied, `v_free` once the group's tail has read them. A phase a pass of the group.
    __shared__ __align__(8) unsigned long long s_ktab_full[XQ_GROUPS], s_ktab_free[XQ_GROUPS], s_v_full[XQ_GROUPS],
        s_v_free[XQ_GROUPS];
    // The CTA's KV heads kvh, kvh + 1, …, XQ_KH of them.
    const int split = blockIdx.x, kvh = blockIdx.y * XQ_KH, seq = blockIdx.z;
    const int num_splits = gridDim.x, kv_heads = gridDim.y * XQ_KH, OUT = kv_heads * D;
    const int lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    // Compute threads: index ct (producers: negative); group grp, the thread's index gt and warp
    // gw within it.
    const int ct = xq_ct(), grp = ct >= 0 ? ct / XQ_GT : 0, gt = ct - grp * XQ_GT, gw = gt >> 5;
    const int wm = gw / XQ_WN, wn = gw % XQ_WN;
    const KvqSlot at = kvq_seq_slot(seq_slots, seq_lens, seq, 1);
    const int slot = at.slot, len = at.len;
    const long head_row = ((long)seq * kv_heads + kvh) * GQA;
    const float scale = rsqrtf((float)D);
#if KVQ_XQ_WGMMA
    xq_build_qfrag(q, head_row, scale, s_qf);
#else
    for (int i = threadIdx.x; i < XQ_QH * D; i += THREADS) s_q[i] = kvq_io_to_f32(q[head_row * D + i]) * scale;
#endif
    for (int i = threadIdx.x; i < XQ_GROUPS * XQ_QH * XQ_VSLD; i += THREADS) s_vsum_all[i] = 0.f;
    for (int i = threadIdx.x; i < XQ_GROUPS * XQ_TVH * XQ_WPART; i += THREADS) (&s_w[0][0])[i] = 0;
    if (threadIdx.x < XQ_GROUPS * 8) (&s_alpha[0][0])[threadIdx.x] = 1.f;
    for (int j = threadIdx.x; j < D / 2; j += THREADS) {
        // A lane's rows are 8 apart: the angle a row further on turns by 8·f_j.
        double sn, cs;
        sincos(8.0 * rope_freq[j], &sn, &cs);
        s_rope_step[j] = make_float2((float)cs, (float)sn);
        s_rope_freq[j] = rope_freq[j];
    }
    if (threadIdx.x < XQ_GROUPS * XQ_QH) {
        const int gg = threadIdx.x / XQ_QH, h = threadIdx.x % XQ_QH;
        s_m[gg][h] = KVQ_NEG_INF;
        s_l[gg][h] = 0.f;
        for (int vh = 0; vh < XQ_TVH; ++vh) s_z[gg][h][vh] = 0.f;
    }
#if KVQ_XQ_WGMMA
    if (threadIdx.x < XQ_STAGES) {
        kvq_mbar_init(kvq_smem_u32(&s_bar[threadIdx.x]), 1);
        // A stage's chunk is read by one group's four warps.
        kvq_mbar_init(kvq_smem_u32(&s_bar[XQ_STAGES + threadIdx.x]), XQ_GW);
    }
    if (threadIdx.x == 0) kvq_mbar_init(kvq_smem_u32(&s_pass_bar), 1);
    if (threadIdx.x < XQ_GROUPS) {
        kvq_mbar_init(kvq_smem_u32(&s_ktab_full[threadIdx.x]), XQ_SETUP_THREADS);
        kvq_mbar_init(kvq_smem_u32(&s_ktab_free[threadIdx.x]), XQ_GW);
        // Each set-up thread arrives twice: after its stores, and once its copies have landed.
        kvq_mbar_init(kvq_smem_u32(&s_v_full[threadIdx.x]), 2 * XQ_SETUP_THREADS);
        kvq_mbar_init(kvq_smem_u32(&s_v_free[threadIdx.x]), XQ_GW);
    }
#endif
    __syncthreads();

    // This group's shares of the shared memory.
    kvq_u8* const s_v = s_v_all + grp * XQ_M * XQ_VLD;
    float* const s_vsum = s_vsum_all + grp * XQ_QH * XQ_VSLD;
    kvq_u32* const s_ktab = (kvq_u32*)((kvq_u8*)s_ktab_all + grp * XQ_KTAB_BYTES);
    // The softmax's weights for V's sums on CUDA cores, over the first column warp's scores: a
    // lane writes a token's weight after reading that token's scores, and no other lane reads them.
    float (*const s_p)[XQ_M] = s_sp[grp][0];

    const unsigned stages_u32 = kvq_smem_u32(stages);
    int t_begin, t_end;
    kvq_split_range(len, split, num_splits, t_begin, t_end);
    const int sink_end = min(SINK, len), v_qend = kvq_quant_end(len, sink_end, VTensor::LOCAL);
    const int k_qend = kvq_quant_end(len, sink_end, KTensor::LOCAL);
    // The compute threads' barrier, and a group's (all threads on the mma.sync path).
    auto sync_compute = [&]() {
        if constexpr (WGMMA) kvq_bar_sync(1, XQ_CT);
        else __syncthreads();
    };
    auto sync_group = [&]() {
        if constexpr (WGMMA) kvq_bar_sync(2 + grp, XQ_GT);
        else __syncthreads();
    };

    // Group gg's V scales and zeros of its tile's row `row` (location vl) on the tensor path,
    // zero elsewhere.
    auto put_v_scales = [&](int gg, int row, const XqLoc& vl, bool tensor_v) {
        float v_s[XQ_TVH], v_z[XQ_TVH];
#pragma unroll
        for (int vh = 0; vh < XQ_TVH; ++vh) v_s[vh] = v_z[vh] = 0.f;
        if (tensor_v) xq_v_scale_zero(vl, v_s, v_z);
#pragma unroll
        for (int vh = 0; vh < XQ_TVH; ++vh) { s_vs[gg][vh][row] = v_s[vh]; s_vz[gg][vh][row] = v_z[vh]; }
    };
    // The group's tile's V rows located by its own threads (one a row), into s_vloc (the CUDA-core
    // sums and the mma.sync path's copies read it).
    auto locate_v = [&](int t0, int n, bool tensor_v) {
        if (gt < XQ_M) {
            XqLoc vl{false, nullptr, nullptr, 0, 0};
            if (gt < n) vl = xq_locate<VTensor>(t0 + gt, len, slot, v_pool, page_table, max_pages, v_sink, v_tail);
            s_vloc[grp][gt] = vl;
            put_v_scales(grp, gt, vl, tensor_v);
        }
    };

    // A group's tile after K's rebuild (acc, in its warps' registers): RoPE, scores, the online
    // softmax and Σ p·l̂_v. Compute threads only.
    auto finish_tile = [&](float (&acc)[XQ_KH][XQ_MT][XQ_NT][4], int t0, int n, bool tensor_v, long base_row0) {
        // 2. RoPE, then each (query head, token) score into s_sp: on the warpgroup path by TF32
        //    MMAs (kvq/xquant/scores.cuh); on mma.sync a warp's columns, summed over the four
        //    lanes of a row, then over the XQ_WN column warps.
        xq_rope(acc, s_rope_freq, s_rope_step, t0, wm, wn, lane);
#if KVQ_XQ_WGMMA
        xq_scores_tc(acc, s_qf, s_sp[grp][0], gw, lane);
#else
#pragma unroll
        for (int h = 0; h < XQ_QH; ++h)
#pragma unroll
            for (int mt = 0; mt < XQ_MT; ++mt) {
                // Query head h scores against its KV head's K.
                const float (&k)[XQ_NT][4] = acc[h / GQA][mt];
                float s0 = 0.f, s1 = 0.f;
#pragma unroll
                for (int nt = 0; nt < XQ_NT; ++nt) {
                    const int j = xq_col(wn, nt) + 2 * tq;
                    const float2 qj = *(const float2*)&s_q[h * D + j];
                    s0 = fmaf(qj.x, k[nt][0], fmaf(qj.y, k[nt][1], s0));
                    s1 = fmaf(qj.x, k[nt][2], fmaf(qj.y, k[nt][3], s1));
                }
                s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
                s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
                s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
                s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
                if (tq == 0) {
                    const int row = wm * XQ_MT * 16 + mt * 16 + g;
                    s_sp[grp][wn][h][row] = s0;
                    s_sp[grp][wn][h][row + 8] = s1;
                }
            }
#endif
        sync_group();
#if KVQ_XQ_WGMMA
        // The tile's V scales, zeros and code rows, from the set-up warps.
        kvq_mbar_wait(kvq_smem_u32(&s_v_full[grp]), (unsigned)(t0 - t_begin) / (2 * XQ_M) & 1);
#endif
        // 3. Online softmax, a warp a query head; on the tensor path also W = p·s in two f16
        //    parts (zero past the tile's tokens) and the zero term Σ p·z. A warp's heads are
        //    unrolled so their chains of shuffles and loads overlap, and a lane takes TPL adjacent
        //    tokens: its scores stay in registers and W goes out in f16 pairs.
        constexpr int TPL = XQ_M / 32;
        static_assert(TPL % 2 == 0, "pairs of tokens a lane");
#pragma unroll
        for (int hi = 0; hi < (XQ_QH + XQ_GW - 1) / XQ_GW; ++hi) {
            const int h = gw + hi * XQ_GW;
            if (h >= XQ_QH) continue;
            float sv[TPL], mx = KVQ_NEG_INF;
#pragma unroll
            for (int i = 0; i < TPL; ++i) {
                const int t = TPL * lane + i;
                float sc = 0.f;
#pragma unroll
                for (int w = 0; w < XQ_WN; ++w) sc += s_sp[grp][w][h][t];
                sv[i] = t < n ? sc : KVQ_NEG_INF;
                mx = fmaxf(mx, sv[i]);
            }
            mx = kvq_warp_max(mx);
            const float m_old = s_m[grp][h], m_new = fmaxf(m_old, mx);
            float sum = 0.f, zsum[XQ_TVH];
#pragma unroll
            for (int vh = 0; vh < XQ_TVH; ++vh) zsum[vh] = 0.f;
            float pv[TPL];
#pragma unroll
            for (int i = 0; i < TPL; ++i) {
                const int t = TPL * lane + i;
                pv[i] = t < n ? expf(sv[i] - m_new) : 0.f;
                if (!tensor_v && t < n) s_p[h][t] = pv[i];   // for V's sums on CUDA cores
                sum += pv[i];
            }
            if (tensor_v) {
#pragma unroll
                for (int vh = 0; vh < XQ_TVH; ++vh)
#pragma unroll
                    for (int i = 0; i < TPL; i += 2) {
                        const int t = TPL * lane + i;
                        const float2 sc = *(const float2*)&s_vs[grp][vh][t];
                        const float2 ze = *(const float2*)&s_vz[grp][vh][t];
                        const float w0 = pv[i] * sc.x, w1 = pv[i + 1] * sc.y;
                        const kvq_u32 hi = kvq_h2_pack(w0, w1);
                        const kvq_u32 lo = kvq_h2_pack(w0 - kvq_f16_to_f32((kvq_u16)hi), w1 - kvq_f16_to_f32((kvq_u16)(hi >> 16)));
                        *(kvq_u32*)&s_w[grp][vh * XQ_WPART + h * XQ_WLD + t] = hi;
                        *(kvq_u32*)&s_w[grp][vh * XQ_WPART + ((XQ_VMERGED ? 4 : 8) + h) * XQ_WLD + t] = lo;
                        zsum[vh] = fmaf(pv[i], ze.x, fmaf(pv[i + 1], ze.y, zsum[vh]));
                    }
            }
            sum = kvq_warp_sum(sum);
#pragma unroll
            for (int vh = 0; vh < XQ_TVH; ++vh) zsum[vh] = kvq_warp_sum(zsum[vh]);
            if (lane == 0) {
                const float alpha = m_old == KVQ_NEG_INF ? 0.f : expf(m_old - m_new);
                s_alpha[grp][h] = alpha;
                s_l[grp][h] = s_l[grp][h] * alpha + sum;
#pragma unroll
                for (int vh = 0; vh < XQ_TVH; ++vh) s_z[grp][h][vh] = s_z[grp][h][vh] * alpha + zsum[vh];
                s_m[grp][h] = m_new;
            }
        }
        // 4. Σ p·l̂_v: the sums rescaled to the new maxima, plus this tile's terms. The tensor
        //    path's accumulators start at zero each tile and join the f32 sums after it (the
        //    tensor cores' own accumulation stays a tile long), rescaling them in the same pass.
        if (tensor_v) {
            if constexpr (!WGMMA) asm volatile("cp.async.wait_group 0;" ::: "memory");
            sync_group();
            float vo[XQ_VMT][4];
#pragma unroll
            for (int i = 0; i < XQ_VMT; ++i) vo[i][0] = vo[i][1] = vo[i][2] = vo[i][3] = 0.f;
            xq_values_mma(vo, s_v, s_w[grp], gw, lane);
            xq_values_merge(vo);
            const int h0 = 2 * tq, h1 = 2 * tq + 1;
            const float a0 = h0 < XQ_QH ? s_alpha[grp][h0] : 0.f, a1 = h1 < XQ_QH ? s_alpha[grp][h1] : 0.f;
            const float f = xq_values_scale(lane);
#pragma unroll
            for (int i = 0; i < XQ_VMT; ++i) {
                const int c = 16 * (XQ_VMT * gw + i) + g;
                if (c < XR) {
                    if (h0 < XQ_QH) {
                        s_vsum[h0 * XQ_VSLD + c] = fmaf(vo[i][0], f, s_vsum[h0 * XQ_VSLD + c] * a0);
                        s_vsum[h0 * XQ_VSLD + c + 8] = fmaf(vo[i][2], f, s_vsum[h0 * XQ_VSLD + c + 8] * a0);
                    }
                    if (h1 < XQ_QH) {
                        s_vsum[h1 * XQ_VSLD + c] = fmaf(vo[i][1], f, s_vsum[h1 * XQ_VSLD + c] * a1);
                        s_vsum[h1 * XQ_VSLD + c + 8] = fmaf(vo[i][3], f, s_vsum[h1 * XQ_VSLD + c + 8] * a1);
                    }
                }
            }
            // The next tile's set-up ends in a group barrier before anything read here is
            // written again (its V rows, W, the scores).
            if constexpr (!WGMMA) sync_group();
        } else {
            // The warpgroup path's set-up warps locate only the tensor path's rows.
            if constexpr (WGMMA) locate_v(t0, n, false);
            sync_group();
            for (int i = gt; i < XQ_QH * XQ_VSLD; i += XQ_GT) s_vsum[i] *= s_alpha[grp][i / XQ_VSLD];
            sync_group();
            xq_values_cuda(s_vloc[grp], s_p, n, CROSS_LAYER ? base_v + base_row0 : nullptr, s_vsum, gt);
            sync_group();
        }
#if KVQ_XQ_WGMMA
        __syncwarp();
        if (lane == 0) kvq_mbar_arrive(kvq_smem_u32(&s_v_free[grp]));
#endif
    };

    // After the last tile (compute threads only, so the warpgroup path's producers, whose code
    // ptxas compiles at their small register budget, never run it).
    auto write_output = [&]() {
        sync_compute();
        if constexpr (XQ_GROUPS == 2) {
            // The groups' softmax states and sums meet in group 0's: each rescaled to the larger
            // maximum of a query head.
            float* const v0 = s_vsum_all;
            const float* const v1 = s_vsum_all + XQ_QH * XQ_VSLD;
            auto weights = [&](int h, float& a0, float& a1, float& m) {
                const float m0 = s_m[0][h], m1 = s_m[1][h];
                m = fmaxf(m0, m1);
                a0 = m0 == KVQ_NEG_INF ? 0.f : expf(m0 - m);
                a1 = m1 == KVQ_NEG_INF ? 0.f : expf(m1 - m);
            };
            for (int i = ct; i < XQ_QH * XQ_VSLD; i += XQ_CT) {
                float a0, a1, m;
                weights(i / XQ_VSLD, a0, a1, m);
                v0[i] = v0[i] * a0 + v1[i] * a1;
            }
            float m = 0.f, l = 0.f, z[XQ_TVH];
            if (ct < XQ_QH) {
                float a0, a1;
                weights(ct, a0, a1, m);
                l = s_l[0][ct] * a0 + s_l[1][ct] * a1;
#pragma unroll
                for (int vh = 0; vh < XQ_TVH; ++vh) z[vh] = s_z[0][ct][vh] * a0 + s_z[1][ct][vh] * a1;
            }
            sync_compute();
            if (ct < XQ_QH) {
                s_m[0][ct] = m;
                s_l[0][ct] = l;
#pragma unroll
                for (int vh = 0; vh < XQ_TVH; ++vh) s_z[0][ct][vh] = z[vh];
            }
            sync_compute();
        }
        // The split's output: (Σ p·l̂_v + Σ p·z)·up_v for this KV head's columns (z that of the
        // channel's store head). Compute thread ct takes four columns, 4·(ct % (D / 4)), over every
        // XQ_OPARTS-th latent from ct / (D / 4), for all query heads at once: each up_v value is read
        // once, by 16-byte loads, many in flight (the loads' latency, not their bytes, bounds this
        // step). The parts meet in the pipeline's shared memory, free by now.
        float* const s_out = (float*)xq_smem;
        const float* const vsum = s_vsum_all;
        if (ct >= 0 && ct < XQ_OPARTS * (D / 4)) {
            const int j = 4 * (ct % (D / 4)), part = ct / (D / 4);
            const float* w = up_v + kvh * D + j;
            float4 sum[XQ_QH];
#pragma unroll
            for (int h = 0; h < XQ_QH; ++h) sum[h] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
            for (int c = part; c < XR; c += XQ_OPARTS) {
                const int vh = XQ_TVH == 1 ? 0 : c / XW;
#pragma unroll
                for (int kh = 0; kh < XQ_KH; ++kh) {
                    // The CTA's KV head kh's columns, for its query heads.
                    const float4 wc = *(const float4*)(w + (long)c * OUT + kh * D);
#pragma unroll
                    for (int h = kh * GQA; h < (kh + 1) * GQA; ++h) {
                        const float x = vsum[h * XQ_VSLD + c] + s_z[0][h][vh];
                        sum[h].x = fmaf(x, wc.x, sum[h].x);
                        sum[h].y = fmaf(x, wc.y, sum[h].y);
                        sum[h].z = fmaf(x, wc.z, sum[h].z);
                        sum[h].w = fmaf(x, wc.w, sum[h].w);
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < XQ_QH; ++h) *(float4*)&s_out[(part * XQ_QH + h) * D + j] = sum[h];
        }
        sync_compute();
        for (int i = ct; ct >= 0 && i < XQ_QH * D; i += XQ_CT) {
            float sum = 0.f;
            for (int part = 0; part < XQ_OPARTS; ++part) sum += s_out[part * XQ_QH * D + i];
            part_acc[((head_row + i / D) * num_splits + split) * D + i % D] = sum;
        }
        if (ct >= 0 && ct < XQ_QH) {
            const int h = ct;
            part_ml[((head_row + h) * num_splits + split) * 2] = s_m[0][h];
            part_ml[((head_row + h) * num_splits + split) * 2 + 1] = s_l[0][h];
        }
    };

#if KVQ_XQ_WGMMA
    // The split's tiles of XQ_M rows are passes p = 0, 1, …: group p % 2 takes pass p, and the
    // producer streams up_k's chunks for the passes in order (kvq/xquant/warpgroup.cuh).
    const int passes = (t_end - t_begin + XQ_M - 1) / XQ_M;
    // Pass p's rows [t0, t0 + n); whether V sums on tensor cores (every row a page row), and
    // whether K decodes from its page's table (the rows of one page: most tiles; others latent
    // by latent).
    struct XqPass { int t0, n; bool tensor_v, fast; };
    auto pass_at = [&](int p) {
        XqPass ps;
        ps.t0 = t_begin + p * XQ_M;
        ps.n = min(XQ_M, t_end - ps.t0);
        ps.tensor_v = TENSOR_V && ps.t0 >= sink_end && ps.t0 + ps.n <= v_qend;
        ps.fast = ps.n == XQ_M && ps.t0 >= sink_end && ps.t0 + ps.n <= k_qend &&
                  (ps.t0 - sink_end) / PAGE == (ps.t0 + ps.n - 1 - sink_end) / PAGE;
        return ps;
    };
    // The role from a warp-uniform value the compiler can see is uniform: the consumers' MMAs
    // must not sit in a branch it takes as divergent, or it serialises them.
    if (__shfl_sync(0xffffffffu, (int)threadIdx.x / XQ_PRODUCERS, 0) == 0) {
        // The producer warpgroup: one thread copies up_k's chunks into the ring.
        kvq_setmaxnreg_dec<XQ_PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            for (int p = 0; p < passes; ++p)
                for (int kc = 0; kc < XQ_CHUNKS; ++kc) {
                    const int st = xq_wg_stage(p, kc), k = xq_wg_load_index(p, kc);
                    kvq_mbar_wait(kvq_smem_u32(&s_bar[XQ_STAGES + st]), (k & 1) ^ 1);
                    xq_wg_copy_b(up_k_groups, kvh, kc * XQ_KC, stages_u32 + st * XQ_WG_STAGE_BYTES, kvq_smem_u32(&s_bar[st]));
                }
        } else if (threadIdx.x >= XQ_PRODUCERS - XQ_SETUP_THREADS) {
            // The set-up warps prepare each pass for its group, in pass order: the page's K
            // table once the group's decode of its pass before has read the table, then the V
            // rows' scales, zeros and code rows once the group's tail of that pass has read
            // them. A group's table is needed when its pass starts and its V rows only at its
            // tail, so both are ready before the group waits for them, and the compute warps no
            // longer start each pass with the page-table and scale loads and a barrier.
            const int st = threadIdx.x - (XQ_PRODUCERS - XQ_SETUP_THREADS);
            for (int p = 0; p < passes; ++p) {
                const int gg = p % 2, use = p / 2;
                const XqPass ps = pass_at(p);
                if (use > 0) kvq_mbar_wait(kvq_smem_u32(&s_ktab_free[gg]), (use - 1) & 1);
                if (ps.fast)
                    xq_build_ktab(xq_locate<KTensor>(ps.t0, len, slot, k_pool, page_table, max_pages, k_sink, k_tail),
                                  (kvq_u32*)((kvq_u8*)s_ktab_all + gg * XQ_KTAB_BYTES), st, XQ_SETUP_THREADS);
                kvq_mbar_arrive(kvq_smem_u32(&s_ktab_full[gg]));
                if (use > 0) kvq_mbar_wait(kvq_smem_u32(&s_v_free[gg]), (use - 1) & 1);
                if (ps.tensor_v) {
                    // Every row a page row, in at most two pages: their blocks looked up once.
                    const int r0 = ps.t0 - sink_end, first = r0 / PAGE, last = (r0 + ps.n - 1) / PAGE;
                    const kvq_i32* pages = page_table + (long)slot * max_pages;
                    const kvq_u8* const b0 = xq_page_block<VTensor>(v_pool, pages, first);
                    const kvq_u8* const b1 = last > first ? xq_page_block<VTensor>(v_pool, pages, last) : b0;
                    auto row_at = [&](int t) {
                        const int r = r0 + t;
                        return XqLoc{true, nullptr, r / PAGE == first ? b0 : b1, r % PAGE, 0};
                    };
                    if (st < XQ_M) put_v_scales(gg, st, st < ps.n ? row_at(st) : XqLoc{false, nullptr, nullptr, 0, 0}, true);
                    xq_copy_v_rows(row_at, ps.n, s_v_all + gg * XQ_M * XQ_VLD, st, XQ_SETUP_THREADS);
                }
                kvq_mbar_arrive(kvq_smem_u32(&s_v_full[gg]));
                kvq_cp_async_mbar_arrive(kvq_smem_u32(&s_v_full[gg]));
            }
            // No copy outlives its thread.
            asm volatile("cp.async.wait_all;" ::: "memory");
        }
    } else {
        // The compute warps: K's rebuild (their own fragments decoded while the previous chunk
        // multiplies), then the tile's scores and sums. Warp gw of a group takes its tile's rows
        // 16·gw + g and + 8.
        kvq_setmaxnreg_inc<XQ_CONSUMER_REGS>();
        const int row0 = 16 * gw + g;
        const unsigned long long ring = kvq_wgmma_desc(stages_u32, XQ_B_KG, 128);
        for (int p = grp; p < passes; p += 2) {
            const XqPass ps = pass_at(p);
            const int t0 = ps.t0, n = ps.n;
            const bool tensor_v = ps.tensor_v, fast = ps.fast;
            bool live[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) live[r] = row0 + 8 * r < n;
            // A fast tile's rows g and g + 8 lie in one page, eight rows apart: one pointer to
            // row g's codes serves both, and the other tiles find each row again a chunk (they
            // are few and slow anyway), which keeps the registers for the codes in flight.
            const kvq_u8* kcodes = nullptr;
            if (fast) {
                const XqLoc l = xq_locate<KTensor>(t0 + row0, len, slot, k_pool, page_table, max_pages, k_sink, k_tail);
                kcodes = l.block + KTensor::CODES_OFFSET + (long)l.row * KTensor::ROW_WORDS * 4;
            }
            float acc[XQ_KH][XQ_MT][XQ_NT][4];
#pragma unroll
            for (int kh = 0; kh < XQ_KH; ++kh)
#pragma unroll
                for (int nt = 0; nt < XQ_NT; ++nt) acc[kh][0][nt][0] = acc[kh][0][nt][1] = acc[kh][0][nt][2] = acc[kh][0][nt][3] = 0.f;
            // Two chunks' fragments (chunk kc's MMAs read fr[kc % 2] while chunk kc + 1 is decoded
            // into the other) and XQ_CODE_BUFS chunks' codes: with four, the codes of chunk kc + 5
            // load at step kc, four steps before they are decoded, which hides a load from L2
            // where two steps did not.
            XqFrag fr[2];
            XqRowCodes codes[XQ_CODE_BUFS][2];
            auto load_codes = [&](XqRowCodes (&c)[2], int kc) {
                if (fast && kc < XQ_CHUNKS) xq_load_page_codes(kcodes, kc, c);
            };
            auto decode = [&](XqFrag& f, const XqRowCodes (&c)[2], int kc) {
                if (fast) {
                    xq_decode_chunk_fast(f, c, s_ktab, kc, tq);
                } else {
                    XqLoc kl[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        kl[r] = live[r] ? xq_locate<KTensor>(t0 + row0 + 8 * r, len, slot, k_pool, page_table, max_pages, k_sink, k_tail)
                                        : XqLoc{false, nullptr, nullptr, 0, 0};
                    xq_decode_chunk_any(f, kl, live, kc, tq);
                }
            };
            // The MMAs of chunk kc are done: its stage's `empty` hears from this warp.
            auto release = [&](int kc) {
                if (lane == 0) kvq_mbar_arrive(kvq_smem_u32(&s_bar[XQ_STAGES + xq_wg_stage(p, kc)]));
            };
            // MMAs of chunk kc; then, once chunk kc − 1 is done (its stage released, its fragments
            // free), chunk kc + 1 decoded into them and the codes of chunk kc + 1 + XQ_CODE_BUFS
            // loaded in place of its codes.
            auto step = [&](int kc) {
                const int st = xq_wg_stage(p, kc);
                kvq_mbar_wait(kvq_smem_u32(&s_bar[st]), xq_wg_load_index(p, kc) & 1);
                if (kc == XQ_CHUNKS - 1 && gt == 0) kvq_mbar_arrive(kvq_smem_u32(&s_pass_bar));
                xq_wg_mma_chunk(acc, fr[kc % 2], ring, st);
                kvq_wgmma_commit();
                if (kc > 0) {
                    kvq_wgmma_wait<1>();
                    release(kc - 1);
                }
                if (kc + 1 < XQ_CHUNKS) {
                    decode(fr[(kc + 1) % 2], codes[(kc + 1) % XQ_CODE_BUFS], kc + 1);
                    load_codes(codes[(kc + 1) % XQ_CODE_BUFS], kc + 1 + XQ_CODE_BUFS);
                }
            };
#pragma unroll
            for (int b = 0; b < XQ_CODE_BUFS; ++b) load_codes(codes[b], b);
            kvq_mbar_wait(kvq_smem_u32(&s_ktab_full[grp]), (p / 2) & 1);
            decode(fr[0], codes[0], 0);
            load_codes(codes[0], XQ_CODE_BUFS);
            // A `full` barrier's parity tells apart only two of its loads: before its first step a
            // pass waits for the pass before to have seen its last chunks land, so every load
            // it waits for is at most one past the ones that completed.
            if (p > 0) kvq_mbar_wait(kvq_smem_u32(&s_pass_bar), (p - 1) & 1);
            // XQ_CODE_BUFS chunks an iteration, so each one's code buffer (and stage, where the
            // stages divide them) is a constant; twice that where the pass has four times as many
            // chunks, so a pass of four chunks or more never unrolls whole (ptxas then put a
            // warpgroup arrive in a divergent path and serialised the MMAs: C7520).
#pragma unroll(XQ_CHUNKS >= 4 * XQ_CODE_BUFS ? 2 : 1)
            for (int kc = 0; kc < XQ_CHUNKS; kc += XQ_CODE_BUFS) {
#pragma unroll
                for (int u = 0; u < XQ_CODE_BUFS; ++u)
                    if (kc + u < XQ_CHUNKS) step(kc + u);
            }
            kvq_wgmma_wait<0>();
            release(XQ_CHUNKS - 1);
            // This warp's decode has read the page's table.
            __syncwarp();
            if (lane == 0) kvq_mbar_arrive(kvq_smem_u32(&s_ktab_free[grp]));
            finish_tile(acc, t0, n, tensor_v, 0);
        }
        write_output();
    }
#else
    const XqAddrs ad = xq_addrs(stages, wm, wn, lane);
    const int my_row = threadIdx.x / XQ_TPR, my_c = (threadIdx.x % XQ_TPR) * XQ_APT;
    for (int t0 = t_begin; t0 < t_end; t0 += XQ_M) {
        const int n = min(XQ_M, t_end - t0);
        const bool live = my_row < n;
        // V on tensor cores where every row of the tile is a page row.
        const bool tensor_v = TENSOR_V && t0 >= sink_end && t0 + n <= v_qend;
        XqLoc kl{false, nullptr, nullptr, 0, 0};
        if (live) kl = xq_locate<KTensor>(t0 + my_row, len, slot, k_pool, page_table, max_pages, k_sink, k_tail);
        // Cross-layer schemes: the tile's rows of the accumulator's latents (row my_row for K).
        const long base_row0 = ((long)slot * base_rows + t0) * XR;
        const kvq_u16* const kb = CROSS_LAYER ? base_k + base_row0 + (long)my_row * XR : nullptr;
        locate_v(t0, n, tensor_v);
        // 1. K = L̂_k·up_k for the tile, through the two-stage pipeline; the tile's V code rows
        //    join the second chunk's copies.
        float acc[XQ_KH][XQ_MT][XQ_NT][4];
#pragma unroll
        for (int mt = 0; mt < XQ_MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < XQ_NT; ++nt) acc[0][mt][nt][0] = acc[0][mt][nt][1] = acc[0][mt][nt][2] = acc[0][mt][nt][3] = 0.f;
        // Tiles of whole pages (most of them) decode K without a branch on the row's kind.
        const bool k_pages = n == XQ_M && t0 >= sink_end && t0 + n <= k_qend;
        XqCodes raw;
        if (live) {
            xq_prefetch_span(kl, my_c, kb);
            if (XQ_CHUNKS > 1) xq_prefetch_span(kl, XQ_KC + my_c, kb);
            xq_load_codes(kl, my_c, raw);
        }
        xq_store_a<false>(raw, kl, live, my_c, kb, stages + my_row * XQ_LD + my_c, stages + XQ_A_HALVES + my_row * XQ_LD + my_c);
        xq_copy_b(ad, up_k_hi, up_k_lo, kvh, 0, stages_u32);
        for (int kc = 0; kc < XQ_CHUNKS; ++kc) {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
            __syncthreads();
            const unsigned cur = (kc & 1) * XQ_STAGE_BYTES, next = XQ_STAGE_BYTES - cur;
            kvq_u16* const next_a = stages + (next / 2) + my_row * XQ_LD + my_c;
            const bool more = kc + 1 < XQ_CHUNKS;
            if (kc == 0 && tensor_v) xq_copy_v_rows([&](int t) { return s_vloc[0][t]; }, n, s_v, gt, XQ_GT);
            if (more) {
                xq_copy_b(ad, up_k_hi, up_k_lo, kvh, (kc + 1) * XQ_KC, stages_u32 + next);
                if (live) {
                    if (kc + 2 < XQ_CHUNKS) xq_prefetch_span(kl, (kc + 2) * XQ_KC + my_c, kb);
                    xq_load_codes(kl, (kc + 1) * XQ_KC + my_c, raw);
                }
            } else if (kc == 0 && tensor_v) {
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
            xq_mma_chunk(acc[0], ad, cur);
            if (more) {
                if (k_pages) xq_store_a<true>(raw, kl, live, (kc + 1) * XQ_KC + my_c, kb, next_a, next_a + XQ_A_HALVES);
                else xq_store_a<false>(raw, kl, live, (kc + 1) * XQ_KC + my_c, kb, next_a, next_a + XQ_A_HALVES);
            }
        }
        finish_tile(acc, t0, n, tensor_v, base_row0);
    }
    write_output();
#endif
}
