// XQuant caches integer-quantized activations; a codebook tensor cannot describe them.
#[kvq::scheme(
    k = codebook(additive, rows = 256),
    v = int(2, token),
    source = x(latent),
)]
struct XCodebook;

fn main() {}
