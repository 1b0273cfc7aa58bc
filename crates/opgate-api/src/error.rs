//! API errors: an HTTP status and a `{"error": {"code", "message"}}` body. 400 names the
//! field at fault, 401/403 for tokens and roles, 404, 409 for a transition the state
//! machine refuses or ledger contents that contradict the request.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An API error.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    /// An error with its status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// 403: the token may not do this.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    /// 400 with a code naming what is wrong.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 for an operation: unknown, or not this principal's to see (the same answer, so
    /// an agent learns nothing about other principals' operations).
    pub fn operation_not_found(id: uuid::Uuid) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("operation {id} not found"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(json!({"error": {"code": self.code, "message": self.message}})),
        )
            .into_response()
    }
}

impl From<opgate_store::Error> for ApiError {
    fn from(e: opgate_store::Error) -> Self {
        match e {
            opgate_store::Error::NotFound(id) => Self::operation_not_found(id),
            opgate_store::Error::IllegalTransition { .. } => {
                Self::new(StatusCode::CONFLICT, "illegal_transition", e.to_string())
            }
            opgate_store::Error::Conflict(message) => {
                Self::new(StatusCode::CONFLICT, "conflict", message)
            }
            other if other.is_deterministic() => {
                tracing::warn!(error = %other, "the ledger refused a value");
                Self::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "ledger_refused",
                    "the ledger refused a value of this request (see the opgate log for the database's reason)",
                )
            }
            other => {
                tracing::error!(error = %other, "ledger error in the API");
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "ledger_unavailable",
                    "the ledger is not available",
                )
            }
        }
    }
}
