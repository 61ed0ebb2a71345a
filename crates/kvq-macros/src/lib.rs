//! `#[kvq::scheme(...)]`: declares a KV-cache quantization scheme on a unit struct.
//!
//! The attribute's tokens are turned back into text and parsed by `kvq_spec`'s parser — the same one
//! the CLI and config files use — so errors read the same everywhere. A grammar error is reported on
//! the token it names. The struct gets `impl kvq::Scheme` with the validated spec as a `const`.

mod spec_tokens;
mod token_text;

use proc_macro::TokenStream;
use quote::quote;
use syn::{parse_macro_input, spanned::Spanned, ItemStruct};

/// Declares a quantization scheme; see the `kvq` crate's documentation for the grammar.
///
/// ```ignore
/// #[kvq::scheme(k = int(2, channel), v = int(2, token), local = 128)]
/// pub struct Kivi2;
/// ```
#[proc_macro_attribute]
pub fn scheme(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item = parse_macro_input!(item as ItemStruct);
    let attr = proc_macro2::TokenStream::from(attr);
    match expand(attr, &item) {
        Ok(tokens) => tokens.into(),
        Err(err) => {
            let err = err.to_compile_error();
            quote!(#item #err).into()
        }
    }
}

fn expand(attr: proc_macro2::TokenStream, item: &ItemStruct) -> syn::Result<proc_macro2::TokenStream> {
    if !matches!(item.fields, syn::Fields::Unit) {
        return Err(syn::Error::new(
            item.fields.span(),
            "#[kvq::scheme] goes on a unit struct (`struct Name;`): the scheme is the type",
        ));
    }
    if !item.generics.params.is_empty() {
        return Err(syn::Error::new(
            item.generics.span(),
            "#[kvq::scheme] structs cannot be generic",
        ));
    }
    let text = token_text::TokenText::new(attr.clone());
    if text.text.trim().is_empty() {
        return Err(syn::Error::new(
            proc_macro2::Span::call_site(),
            "#[kvq::scheme] needs a scheme, e.g. #[kvq::scheme(k = int(2, channel), v = int(2, token))]",
        ));
    }
    let spec = kvq_spec::SchemeSpec::parse(&text.text)
        .map_err(|e| syn::Error::new(text.span_of(e.span.clone()), e.message))?;
    let spec_tokens = spec_tokens::spec(&spec);
    let name = &item.ident;
    let name_text = name.to_string();
    let canonical = spec.to_string();
    let doc = format!("Scheme: `{canonical}`");
    Ok(quote! {
        #[doc = #doc]
        #item
        impl ::kvq::Scheme for #name {
            const SPEC: ::kvq::SchemeSpec = #spec_tokens;
            const NAME: &'static str = #name_text;
        }
    })
}
