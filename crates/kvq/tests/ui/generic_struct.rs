#[kvq::scheme(k = int(2, channel), v = int(2, token))]
struct Generic<const BITS: u8>;

fn main() {}
