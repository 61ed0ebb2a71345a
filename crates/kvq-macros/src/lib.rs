//! `#[kvq::scheme(...)]`: declares a KV-cache quantization scheme on a unit struct.
//!
//! The attribute's tokens are turned back into text and parsed by `kvq_spec`'s parser — the same one
//! the CLI and config files use — so errors read the same everywhere. A grammar error is reported on
//! the tokens it names. The struct gets `impl kvq::Scheme` with the validated spec as a `const`.

mod spec_tokens;
mod token_text;

use proc_macro2::{Span, TokenStream};
use quote::{quote, ToTokens};
use syn::{spanned::Spanned, Item, ItemStruct};

/// Declares a quantization scheme; see `docs/GRAMMAR.md` for the grammar.
///
/// ```ignore
/// #[kvq::scheme(k = int(2, channel), v = int(2, token), local = 128)]
/// pub struct Kivi2;
/// ```
#[proc_macro_attribute]
pub fn scheme(
    attr: proc_macro::TokenStream,
    item: proc_macro::TokenStream,
) -> proc_macro::TokenStream {
    let item = TokenStream::from(item);
    match expand(attr.into(), item.clone()) {
        Ok(tokens) => tokens.into(),
        // Keep the item, so that a bad scheme gives one error rather than one per use of the type.
        Err(err) => {
            let err = err.to_compile_error();
            quote!(#item #err).into()
        }
    }
}

const ON_UNIT_STRUCT: &str =
    "#[kvq::scheme] goes on a unit struct (`struct Name;`): the scheme is the type";

fn expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let mut item = match syn::parse2::<Item>(item)? {
        Item::Struct(s) => s,
        other => {
            let (keyword, kind) = item_keyword(&other);
            return Err(syn::Error::new(
                keyword,
                format!("{ON_UNIT_STRUCT}, not {kind}"),
            ));
        }
    };
    check_struct(&item)?;
    let text = token_text::TokenText::new(attr);
    if text.text.trim().is_empty() {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[kvq::scheme] needs a scheme, e.g. #[kvq::scheme(k = int(2, channel), v = int(2, token))]",
        ));
    }
    let spec = kvq_spec::SchemeSpec::parse(&text.text).map_err(|e| {
        let (first, last) = text.spans_of(e.span.clone());
        syn::Error::new_spanned(span_range(first, last), e.message)
    })?;
    let spec_tokens = spec_tokens::spec(&spec);
    let canonical = spec.to_string();
    // After the user's own docs, so their first line stays the summary.
    let separator = if item.attrs.iter().any(|a| a.path().is_ident("doc")) {
        quote!(#[doc = ""])
    } else {
        TokenStream::new()
    };
    let doc = format!("Scheme: `{canonical}`");
    item.attrs.extend(syn::parse::Parser::parse2(
        syn::Attribute::parse_outer,
        quote!(#separator #[doc = #doc]),
    )?);
    let name = &item.ident;
    let name_text = name.to_string();
    Ok(quote! {
        #item
        impl ::kvq::Scheme for #name {
            const SPEC: ::kvq::SchemeSpec = #spec_tokens;
            const NAME: &'static str = #name_text;
            const TEXT: &'static str = #canonical;
        }
    })
}

fn check_struct(item: &ItemStruct) -> syn::Result<()> {
    if !matches!(item.fields, syn::Fields::Unit) {
        return Err(syn::Error::new(
            item.fields.span(),
            format!("{ON_UNIT_STRUCT}; remove the fields"),
        ));
    }
    if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
        return Err(syn::Error::new_spanned(
            &item.generics,
            "#[kvq::scheme] structs cannot be generic",
        ));
    }
    Ok(())
}

/// The keyword that names an item's kind, and the kind in words.
fn item_keyword(item: &Item) -> (Span, &'static str) {
    match item {
        Item::Enum(i) => (i.enum_token.span, "an enum"),
        Item::Fn(i) => (i.sig.fn_token.span, "a function"),
        Item::Union(i) => (i.union_token.span, "a union"),
        Item::Trait(i) => (i.trait_token.span, "a trait"),
        Item::Type(i) => (i.type_token.span, "a type alias"),
        Item::Const(i) => (i.const_token.span, "a const"),
        Item::Static(i) => (i.static_token.span, "a static"),
        Item::Mod(i) => (i.mod_token.span, "a module"),
        Item::Impl(i) => (i.impl_token.span, "an impl block"),
        other => (other.span(), "this item"),
    }
}

/// Two tokens carrying `first` and `last`: an error spanned on them covers everything between, which
/// `Span::join` cannot do on a stable compiler.
fn span_range(first: Span, last: Span) -> TokenStream {
    let mut tokens = TokenStream::new();
    for span in [first, last] {
        let mut p = proc_macro2::Punct::new(',', proc_macro2::Spacing::Alone);
        p.set_span(span);
        p.to_tokens(&mut tokens);
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_text(attr: TokenStream, item: TokenStream) -> String {
        match expand(attr, item) {
            Ok(t) => t.to_string(),
            Err(e) => format!("error: {e}"),
        }
    }

    #[test]
    fn doc_line_follows_user_docs() {
        let out = expand_text(
            quote!(k = int(2, channel), v = fp16),
            quote!(
                /// Mine.
                pub struct S;
            ),
        );
        let mine = out.find("Mine.").unwrap_or(usize::MAX);
        let scheme = out
            .find("Scheme: `k = int(bits = 2, axis = channel), v = fp16, page = 128`")
            .unwrap_or(0);
        assert!(mine < scheme, "{out}");
        assert!(out.contains("const TEXT : & 'static str = \"k = int(bits = 2, axis = channel), v = fp16, page = 128\""), "{out}");
    }

    #[test]
    fn undocumented_struct_gets_only_the_scheme_line() {
        let out = expand_text(
            quote!(k = fp16, v = fp16),
            quote!(
                struct S;
            ),
        );
        assert!(
            out.starts_with("# [doc = \"Scheme: `k = fp16, v = fp16, page = 128`\"] struct S ;"),
            "{out}"
        );
    }

    #[test]
    fn errors_name_the_problem() {
        let out = expand_text(
            quote!(k = fp16, v = fp16),
            quote!(
                enum E {}
            ),
        );
        assert!(out.contains("not an enum"), "{out}");
        let out = expand_text(
            quote!(k = fp16, v = fp16),
            quote!(
                struct S<T>;
            ),
        );
        assert!(out.contains("cannot be generic"), "{out}");
        let out = expand_text(
            quote!(),
            quote!(
                struct S;
            ),
        );
        assert!(out.contains("needs a scheme"), "{out}");
        let out = expand_text(
            quote!(k = int(9, channel), v = fp16),
            quote!(
                struct S;
            ),
        );
        assert_eq!(out, "error: `bits` must be 1, 2, 3, 4 or 8, got `9`");
    }

    #[test]
    fn deep_nesting_is_refused_without_deep_recursion() {
        // On a small stack, so flattening the tokens recursively would abort the test.
        let out = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(|| {
                let levels = 5_000;
                let text = format!(
                    "k = {}fp16{}, v = fp16",
                    "a(".repeat(levels),
                    ")".repeat(levels)
                );
                let attr: TokenStream = text.parse().expect("balanced tokens");
                let item = quote!(
                    struct S;
                );
                let tokens = token_text::TokenText::new(attr.clone());
                assert_eq!(tokens.text, text.replace(' ', ""));
                let out = expand_text(attr, item);
                // Tear the deep token tree down here too, as the compiler would.
                drop(tokens);
                out
            })
            .expect("spawn")
            .join()
            .expect("no panic");
        assert_eq!(
            out,
            "error: `a(` nests calls 33 deep; scheme text allows at most 32 (a valid scheme needs 2)"
        );
    }
}
