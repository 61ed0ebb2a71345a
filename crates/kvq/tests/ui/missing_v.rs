#[kvq::scheme(k = int(2, channel), local = 128)]
struct KeysOnly;

fn main() {}
