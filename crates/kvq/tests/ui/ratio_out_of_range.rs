#[kvq::scheme(
    k = int(2, channel, boost = boost(4, ratio = 1.5)),
    v = int(2, token),
)]
struct AllBoosted;

fn main() {}
