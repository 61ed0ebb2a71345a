#[kvq::scheme(
    k = fp16,
    v = codebook(rope_commutative, levels = 16, residuals = 4, pairs_per_code = 8),
)]
struct RopeValues;

fn main() {}
