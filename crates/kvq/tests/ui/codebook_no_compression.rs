// 64 rounds of 16 levels per RoPE pair: 256 bits per scalar.
#[kvq::scheme(
    k = codebook(rope_commutative, levels = 16, residuals = 64, pairs_per_code = 1),
    v = fp16,
)]
struct Bloated;

fn main() {}
