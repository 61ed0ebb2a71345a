#[kvq::scheme(
    k = int(4, channel, boost = boost(4, ratio = 0.125)),
    v = int(2, token),
)]
struct NoBoost;

fn main() {}
