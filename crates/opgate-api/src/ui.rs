//! The operator console at `/ui/`: a page, a script and a stylesheet embedded in the
//! binary (plain JavaScript, no build step), served without a token. Every figure it
//! shows comes from the `/v1` routes with the token the person signs in with, so it can
//! do exactly what that token may: a viewer sees, an operator also acts.
//!
//! The page is served with a Content-Security-Policy that allows only its own script,
//! style and API (no inline script, no other origin), and the script writes every value
//! as text, never as markup: an argument or a provider answer cannot run in the console.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;

const INDEX: &str = include_str!("../ui/index.html");
const SCRIPT: &str = include_str!("../ui/console.js");
const STYLE: &str = include_str!("../ui/console.css");

const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `/ui` (redirects to `/ui/`), `/ui/`, `/ui/console.js`, `/ui/console.css`.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route(
            "/ui/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route(
            "/ui/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/ui/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}
