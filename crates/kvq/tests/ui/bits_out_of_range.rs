#[kvq::scheme(k = int(5, channel), v = int(2, token))]
struct FiveBits;

fn main() {}
