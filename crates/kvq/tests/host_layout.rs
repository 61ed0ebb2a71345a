//! Where the tensor-core decode kernel finds each channel of a row, checked on the host: the
//! layout maps of `kernels/include/kvq/decode/slabs.cuh` (the slab shares a lane loads, the halves
//! and pairs V codes convert into, the pairs of K codes on the f16 path, the contiguous blocks of
//! the integer path's byte registers, and of queries and scales) are plain C++, so this test compiles that header
//! with the host's C++ compiler, once per (scheme, head_dim) with the slab constants kvq-codegen
//! renders, loads rows of known codes through `kvq_load_share` and checks that every block-order
//! channel the kernel converts is the code of the channel the slabs say it is. A GPU run is then
//! needed only for what the maps feed. Needs the host C++ compiler (`$CXX`, else `c++`): without
//! one the test shows as ignored, a failure under `KVQ_REQUIRE_CC=1`.

mod common;
use common::run_trials;
use kvq::codegen::{decode_kernels, kernel_headers, Dtype, KernelShape, TuneParams};
use kvq::runtime::testing::harness::checked;
use kvq::runtime::testing::{cxx_compiler, Skip};
use kvq::SchemeSpec;

fn main() {
    run_trials(vec![checked(
        "every_slab_share_lands_where_the_kernel_reads_it",
        every_slab_share_lands_where_the_kernel_reads_it,
    )])
}

/// Code widths and paths the maps serve: integer-path 1- and 2-bit keys (2-bit ones calibrated
/// too, with planes masked in place in pairs), f16-path 1-, 4-, 8- and 16-bit keys, and V of every
/// width.
const SCHEMES: &[(&str, &str)] = &[
    ("kivi2", "k = int(2, channel), v = int(2, token)"),
    ("kivi4", "k = int(4, channel), v = int(4, token)"),
    ("int8", "k = int(8, channel), v = int(8, channel)"),
    ("fp16", "k = fp16, v = fp16"),
    ("one-bit-kv", "k = int(1, channel), v = int(1, token)"),
    (
        "calibrated-two-bit",
        "k = int(2, channel), v = int(2, token), calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
    ),
    (
        "calibrated-one-bit",
        "k = int(1, channel), v = int(1, channel), calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
    ),
];

/// The value of `name = …` (up to `,` or `;`) in a rendered unit.
fn constant(unit: &str, name: &str) -> String {
    let pattern = format!(" {name} = ");
    let line = unit
        .lines()
        .find(|l| l.contains(&pattern))
        .unwrap_or_else(|| panic!("no `{name}` in the unit"));
    let at = line.find(&pattern).unwrap() + pattern.len();
    line[at..]
        .split([',', ';'])
        .next()
        .unwrap()
        .trim()
        .to_string()
}

/// One (scheme, head_dim) as a namespace of the host program: the unit's constants, the header,
/// and the checks.
fn config(index: usize, name: &str, head_dim: u32, unit: &str, header: &str) -> String {
    let mut out =
        format!("namespace c{index} {{\nstatic const char* NAME = \"{name} d{head_dim}\";\n");
    for c in ["D", "DVK", "DVV", "KBITS", "VBITS", "K_PLANES_IN_PLACE"] {
        out += &format!("static constexpr int {c} = {};\n", constant(unit, c));
    }
    for side in ['K', 'V'] {
        for i in 0..4 {
            let c = format!("KVQ_{side}SLAB{i}");
            out += &format!("static constexpr int {c} = {};\n", constant(unit, &c));
        }
    }
    out += &format!(
        "static constexpr bool K_INT = {};\nstatic constexpr bool K_QUANT = {};\nstatic constexpr bool V_QUANT = {};\n",
        constant(unit, "K_INT"),
        constant(unit, "K_QUANT"),
        constant(unit, "V_QUANT"),
    );
    out += &header.replace("#pragma once", "");
    out += CHECKS;
    out += "}\n";
    out
}

/// The checks, in each configuration's namespace. Channel c of a row of BITS-bit codes sits at
/// bit c·BITS (LAYOUT.md); a part's block-order channel j is found from the slab sizes alone
/// (`channel_of`), not from the header's helpers.
const CHECKS: &str = r#"
template <int BITS> kvq_u32 code_of(int c) {
    const kvq_u32 h = (kvq_u32)(c + 1) * 2654435761u;
    return BITS == 16 ? (h >> 16) : (h >> 20) & ((1u << BITS) - 1u);
}
template <int BITS> void pack(kvq_u8* row) {
    std::memset(row, 0, 1024);
    for (int c = 0; c < D; ++c)
        for (int b = 0; b < BITS; ++b)
            if ((code_of<BITS>(c) >> b) & 1u) row[(c * BITS + b) / 8] |= (kvq_u8)(1u << ((c * BITS + b) % 8));
}
template <int BITS> kvq_u32 field(const kvq_u32* w, int bit) {
    return (w[bit / 32] >> (bit % 32)) & (BITS == 32 ? ~0u : ((1u << BITS) - 1u));
}
template <int PARTS> int channel_of(int j, int p) {
    const int s[4] = {PARTS == 4 ? KVQ_KSLAB0 : KVQ_VSLAB0, PARTS == 4 ? KVQ_KSLAB1 : KVQ_VSLAB1,
                      PARTS == 4 ? KVQ_KSLAB2 : KVQ_VSLAB2, PARTS == 4 ? KVQ_KSLAB3 : KVQ_VSLAB3};
    int start = 0, b = 0;
    for (int i = 0; i < 4 && s[i] > 0; ++i) {
        const int share = s[i] / PARTS;
        if (j < b + share) return start + p * share + (j - b);
        b += share;
        start += s[i];
    }
    return -1;
}
template <int BITS> kvq_u32 expected(int c) { return c >= 0 && c < D ? code_of<BITS>(c) : 0u; }
#define KVQ_EXPECT(cond, ...) do { if (!(cond)) { if (failures++ < 20) { std::printf("%s: ", NAME); std::printf(__VA_ARGS__); std::printf("\n"); } } } while (0)

// The halves of a V block and the pairs each yields, as the kernel's KvqVHalfOf gives them.
template <int BITS, int H = 0> void v_halves(int* first, int* pairs) {
    if constexpr (H < kvq_block_halves<8, BITS>()) {
        first[H] = KvqVHalfOf<BITS, H>::FIRST;
        pairs[H] = KvqVHalfOf<BITS, H>::PAIRS;
        v_halves<BITS, H + 1>(first, pairs);
    }
}

// V: pair q of half h is the field at bit q·BITS of that half (KvqPairs::get), block channel
// FIRST(h) + q; every block channel once; the output's owner map inverts the share map.
template <int BITS> void check_v() {
    static kvq_u8 row[1024];
    pack<BITS>(row);
    int first[64], pairs[64];
    v_halves<BITS>(first, pairs);
    constexpr int NH = kvq_block_halves<8, BITS>();
    for (int p = 0; p < 8; ++p) {
        kvq_u32 w[64] = {};
        kvq_load_share<8, BITS, 16>(row, p, w);
        int seen[64] = {};
        for (int h = 0; h < NH; ++h) {
            KVQ_EXPECT(pairs[h] * BITS <= 16 && pairs[h] > 0, "V half %d holds %d pairs", h, pairs[h]);
            for (int q = 0; q < pairs[h]; ++q) {
                const int j = first[h] + q, c = channel_of<8>(j, p);
                KVQ_EXPECT(j >= 0 && j < DVV / 8, "V half %d pair %d: block channel %d", h, q, j);
                if (j < 0 || j >= DVV / 8) continue;
                ++seen[j];
                const kvq_u32 got = field<BITS>(w, 16 * h + q * BITS);
                KVQ_EXPECT(got == expected<BITS>(c), "V%d part %d channel %d: got %x, want %x", BITS, p, c, got, expected<BITS>(c));
                KVQ_EXPECT(kvq_share_channel<8>(j, p) == c, "V share channel of %d/%d", j, p);
                KVQ_EXPECT(kvq_v_pair_pos<BITS>(j) == kvq_pair_pos<BITS>(q), "V pair position of %d", j);
                int g = -1, jj = -1;
                kvq_v_owner(c, g, jj);
                KVQ_EXPECT(g == p && jj == j, "owner of V channel %d: (%d, %d), want (%d, %d)", c, g, jj, p, j);
            }
        }
        for (int j = 0; j < DVV / 8; ++j) KVQ_EXPECT(seen[j] == 1, "V block channel %d converted %d times", j, seen[j]);
    }
}

template <int BITS, int S> kvq_u32 spread_word(const kvq_u32* w) {
    if constexpr (kvq_kf_spread_codes<BITS>(S) > 0) return kvq_spread_word<BITS, S>(w);
    else return 0u;
}
// K on the f16 path: pair q holds block channels kvq_pair_lo/hi(q); a whole word m yields field
// f of its low half and of its high half, a spread half of n codes its codes f and f + n/2.
// Channels past the row (DVK > D) must read as zeros.
template <int BITS> void check_k_f16() {
    static kvq_u8 row[1024];
    pack<BITS>(row);
    for (int p = 0; p < 4; ++p) {
        kvq_u32 w[128] = {};   // the block's words, then (from word 64) its spread halves
        kvq_u32* const spread = w + 64;
        kvq_load_share<4, BITS, 16>(row, p, w);
        int seen[128] = {};
        for (int q = 0; q < DVK / 8; ++q) {
            int lo_bit, hi_bit;
            if (q < kvq_k_word_pairs<BITS>()) {
                const int m = q / (16 / BITS), f = q % (16 / BITS);
                lo_bit = 32 * m + f * BITS;
                hi_bit = lo_bit + 16;
            } else {
                // A spread half as the kernel spreads it: pair f is field f of each half.
                const int sh = kvq_kf_spread_of<BITS>(q), f = q - kvq_kf_spread_pair0<BITS>(sh);
                spread[0] = spread_word<BITS, 0>(w);
                spread[1] = spread_word<BITS, 1>(w);
                spread[2] = spread_word<BITS, 2>(w);
                lo_bit = 32 * (64 + sh) + f * BITS;
                hi_bit = lo_bit + 16;
            }
            const int lo = kvq_pair_lo<BITS>(q), hi = kvq_pair_hi<BITS>(q);
            KVQ_EXPECT(lo >= 0 && lo < DVK / 4 && hi >= 0 && hi < DVK / 4, "K pair %d: channels %d, %d", q, lo, hi);
            if (lo < 0 || lo >= DVK / 4 || hi < 0 || hi >= DVK / 4) continue;
            ++seen[lo];
            ++seen[hi];
            const kvq_u32 a = field<BITS>(w, lo_bit), b = field<BITS>(w, hi_bit);
            KVQ_EXPECT(a == expected<BITS>(channel_of<4>(lo, p)), "K%d part %d pair %d low: got %x, want %x", BITS, p, q, a, expected<BITS>(channel_of<4>(lo, p)));
            KVQ_EXPECT(b == expected<BITS>(channel_of<4>(hi, p)), "K%d part %d pair %d high: got %x, want %x", BITS, p, q, b, expected<BITS>(channel_of<4>(hi, p)));
        }
        for (int j = 0; j < DVK / 4; ++j) KVQ_EXPECT(seen[j] == 1, "K block channel %d in %d pairs", j, seen[j]);
    }
}

// K on the integer path: byte i of byte register x (kvq_int_key_regs: planes of whole words, then
// the sub-word units) is the code of block channel kvq_byte_channel(x, i) times the register's
// plane scale, or 0 where no channel is; every block channel in one slot.
template <int BITS = KBITS> void check_k_int() {
    static kvq_u8 row[1024];
    pack<BITS>(row);
    for (int p = 0; p < 4; ++p) {
        kvq_u32 w[64] = {}, kb[64] = {};
        kvq_load_share<4, KBITS, 16>(row, p, w);
        kvq_int_key_regs(w, kb);
        int seen[128] = {};
        for (int x = 0; x < 2 * KVQ_K_INT_STEPS; ++x)
            for (int i = 0; i < 4; ++i) {
                const int ch = kvq_byte_channel<KBITS>(x, i);
                const kvq_u32 got = (kb[x] >> (8 * i)) & 0xffu;
                KVQ_EXPECT(ch >= -1 && ch < DVK / 4, "K register %d byte %d: channel %d", x, i, ch);
                if (ch < -1 || ch >= DVK / 4) continue;
                if (ch >= 0) ++seen[ch];
                const kvq_u32 want = ch < 0 ? 0u : expected<KBITS>(channel_of<4>(ch, p)) * (kvq_u32)kvq_plane_scale<KBITS>(x);
                KVQ_EXPECT(got == want, "K%d int part %d register %d byte %d (block channel %d): got %x, want %x", KBITS, p, x, i, ch, got, want);
            }
        for (int j = 0; j < DVK / 4; ++j) KVQ_EXPECT(seen[j] == 1, "K block channel %d in %d slots", j, seen[j]);
    }
}

// Contiguous blocks (K codes on the integer path; queries and scales, BITS = 16, also as the
// integer fold's two windows): block channel j of the window at bit (j − V0)·BITS.
template <int BITS, int V0 = 0, int N = DVK / 4> void check_k_contiguous() {
    static kvq_u8 row[1024];
    pack<BITS>(row);
    for (int p = 0; p < 4; ++p) {
        kvq_u32 w[64] = {};
        kvq_load_share<4, BITS, 16, V0, N>(row, p, w);
        for (int j = V0; j < V0 + N; ++j) {
            const int c = channel_of<4>(j, p);
            const kvq_u32 got = field<BITS>(w, (j - V0) * BITS);
            KVQ_EXPECT(got == expected<BITS>(c), "K%d window %d part %d block channel %d (channel %d): got %x, want %x", BITS, V0, p, j, c, got, expected<BITS>(c));
            KVQ_EXPECT(kvq_share_channel<4>(j, p) == c, "K share channel of %d/%d", j, p);
        }
    }
}

// Quantized K and V rows load with PAST (kvq_load_subtiles, kvq_chunk_pv): bytes after the row
// are read but unused. With junk after the row's padded words, every channel inside the row loads
// as it does without PAST, and without PAST the channels past the row still load as zeros.
template <int PARTS, int BITS> int bit_of(int j) {
    for (int i = 0; i < kvq_slab_count<PARTS>(); ++i)
        if (j >= kvq_slab_start<PARTS>(i) / PARTS && j < kvq_slab_start<PARTS>(i + 1) / PARTS)
            return kvq_share_at<PARTS, BITS>(i) + (j - kvq_slab_start<PARTS>(i) / PARTS) * BITS;
    return -1;
}
template <int PARTS, int BITS> void check_past() {
    static kvq_u8 row[1024];
    pack<BITS>(row);
    for (int b = (D * BITS + 31) / 32 * 4; b < 1024; ++b) row[b] = (kvq_u8)(0xa5u ^ (unsigned)b);
    constexpr int N = (PARTS == 4 ? DVK : DVV) / PARTS;
    for (int p = 0; p < PARTS; ++p) {
        kvq_u32 w0[64] = {}, w1[64] = {};
        kvq_load_share<PARTS, BITS, 16>(row, p, w0);
        kvq_load_share<PARTS, BITS, 16, 0, N, 0, true>(row, p, w1);
        for (int j = 0; j < N; ++j) {
            const int c = channel_of<PARTS>(j, p), at = bit_of<PARTS, BITS>(j);
            KVQ_EXPECT(at >= 0, "%s block channel %d has no bit", PARTS == 4 ? "K" : "V", j);
            if (at < 0) continue;
            const kvq_u32 a = field<BITS>(w0, at), b = field<BITS>(w1, at);
            if (c < D) KVQ_EXPECT(a == expected<BITS>(c) && b == a, "%s%d past part %d channel %d: %x and %x, want %x", PARTS == 4 ? "K" : "V", BITS, p, c, a, b, expected<BITS>(c));
            else KVQ_EXPECT(a == 0u, "%s%d part %d channel %d past the row: %x", PARTS == 4 ? "K" : "V", BITS, p, c, a);
        }
    }
}

void check() {
    if constexpr (K_QUANT) check_past<4, KBITS>();
    if constexpr (V_QUANT) check_past<8, VBITS>();
    if constexpr (V_QUANT) check_v<VBITS>(); else check_v<16>();
    if constexpr (K_QUANT && K_INT) check_k_int();
    else if constexpr (K_QUANT) check_k_f16<KBITS>();
    else check_k_f16<16>();
    check_k_contiguous<16>();
    check_k_contiguous<16, 0, DVK / 8>();
    check_k_contiguous<16, DVK / 8, DVK / 8>();
}
"#;

const PRELUDE: &str = r#"
#include <cstdio>
#include <cstring>
#define __device__
#define __host__
#define __forceinline__ inline
typedef unsigned char kvq_u8;
typedef unsigned short kvq_u16;
typedef unsigned int kvq_u32;
static int failures = 0;
// PTX prmt (byte permute, as the kernel's kvq_prmt): byte i of the result is byte sel_i of b:a.
inline kvq_u32 kvq_prmt(kvq_u32 a, kvq_u32 b, kvq_u32 sel) {
    const unsigned long long x = ((unsigned long long)b << 32) | a;
    kvq_u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= (kvq_u32)((x >> (8 * ((sel >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
// The kernel's vector loads, as plain copies (BYTES < 4 fill a word's low bytes).
template <int BYTES> inline void kvq_load(const kvq_u8* p, kvq_u32* w) {
    if (BYTES >= 4) { std::memcpy(w, p, BYTES); } else { kvq_u32 x = 0; std::memcpy(&x, p, BYTES); w[0] = x; }
}
"#;

fn every_slab_share_lands_where_the_kernel_reads_it() -> Result<(), Skip> {
    let cxx = cxx_compiler()?;
    let header = kernel_headers()
        .iter()
        .find(|(name, _)| *name == "kvq/decode/slabs.cuh")
        .map(|(_, text)| *text)
        .expect("slabs.cuh is a kernel header");
    let mut program = PRELUDE.to_string();
    let mut names = Vec::new();
    for (name, text) in SCHEMES {
        let spec = SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        for head_dim in (64..=256).step_by(16) {
            let shape = KernelShape::new(head_dim, 4, Dtype::F16);
            let tune = TuneParams::default_for(&spec, &shape);
            let unit = decode_kernels(&spec, &shape, &tune)
                .unwrap_or_else(|e| panic!("{name} d{head_dim}: {e}"))
                .source;
            assert!(
                unit.contains(" DVK = "),
                "{name} d{head_dim}: not the tensor-core kernel"
            );
            program += &config(names.len(), name, head_dim, &unit, header);
            names.push(format!("{name} d{head_dim}"));
        }
    }
    program += "int main() {\n";
    for i in 0..names.len() {
        program += &format!("    c{i}::check();\n");
    }
    program +=
        "    std::printf(\"%d failures\\n\", failures);\n    return failures == 0 ? 0 : 1;\n}\n";

    let dir = std::env::temp_dir().join(format!("kvq-host-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let source = dir.join("layout.cpp");
    let binary = dir.join("layout");
    std::fs::write(&source, &program).unwrap();
    let build = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-Wno-unknown-pragmas", "-o"])
        .arg(&binary)
        .arg(&source)
        .output()
        .expect("run the C++ compiler");
    assert!(
        build.status.success(),
        "{cxx} failed on {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&build.stderr)
    );
    let run = std::process::Command::new(&binary)
        .output()
        .expect("run the layout checks");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        run.status.success(),
        "layout checks over {} configurations failed:\n{stdout}",
        names.len()
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
    Ok(())
}
