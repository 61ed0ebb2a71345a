#pragma once
// How one side (K or V) of a codebook scheme is stored (kvq_reference::commvq::device, docs/CODEBOOKS.md
// §5). A unit describes each side as a struct of static constexpr members, every one present:
//   KIND          KvqCbKind below;
//   BLOCK_BYTES   one (page, KV head) block: FP16 pages P × D f16; coded pages codes then scales;
//   CODES_OFFSET, SCALES_OFFSET   bytes into a coded block (codes u32, per-token f16 scales/factors);
//   LOCAL, TAIL_CAP   the FP16 local window and the tail ring's rows (local + page);
//   LEVELS, RESIDUALS, PAIRS, GROUPS, CODE_BITS, STREAM_WORDS   RoPE-commutative codes: entries per
//                 pair in each round, rounds, pairs a code, groups a head, bits a code (a and b), words of
//                 one (group, round) stream of the page's codes;
//   ROWS          binary additive codes: rows of the codebook (bits a code);
//   TOKEN_SCALE   RoPE-commutative keys with span = token: a token's one scale is its norm over all KV
//                 heads (each head's block repeats it).
enum class KvqCbKind : int { Fp16 = 0, Rope = 1, Additive = 2 };
