// A key given positionally and by name, or a flag repeated, is that key given twice: the error is
// on the second.
#[kvq::scheme(k = int(2, channel, bits = 4), v = int(2, token))]
struct PositionalAndKeyed;

#[kvq::scheme(k = int(8, channel, symmetric, symmetric), v = fp16)]
struct RepeatedFlag;

fn main() {}
