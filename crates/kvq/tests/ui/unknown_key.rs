// A misspelt key is reported on itself, with the keys allowed there.
#[kvq::scheme(k = int(2, channel), v = int(2, token), sinks = 32)]
struct Typo;

fn main() {}
