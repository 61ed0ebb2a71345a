// 2-bit codes pack 16 to a 32-bit word, so a per-token group must be a multiple of 16 channels.
#[kvq::scheme(k = int(2, channel), v = int(2, token, group = 24))]
struct OddGroup;

fn main() {}
