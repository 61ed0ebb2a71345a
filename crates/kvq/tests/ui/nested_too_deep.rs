// Calls nest at most 32 deep (a valid scheme needs 2); deeper text is refused at the first call past
// the limit, however deep it goes, without the macro or the parser recursing further.
#[kvq::scheme(
    k = a(a(a(a(a(a(a(a(a(a(
        a(a(a(a(a(a(a(a(a(a(
        a(a(a(a(a(a(a(a(a(a(
        a(a(a(a(a(a(a(a(a(a(fp16))))))))))
        )))))))))))))))))))))))))))))),
    v = fp16
)]
struct Deep;

fn main() {}
