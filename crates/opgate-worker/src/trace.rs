//! OpenTelemetry spans for provider calls and lookups. Each call is a span, the child of
//! the operation's W3C `traceparent` (the proposing agent's trace), and the provider is
//! sent a `traceparent` naming that span, so its own spans nest under opgate's call.
//! The binary installs an OTLP exporter when `[telemetry] otlp_endpoint` is set; without
//! one, spans are not recorded and the operation's own `traceparent` is passed on.

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue, global};
use opgate_core::Operation;
use uuid::Uuid;

/// A W3C `traceparent` (`00-{trace id}-{parent id}-{flags}`) as a remote span context;
/// `None` for anything else (the value is advisory: a bad one starts no trace).
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00"
        || parts.next().is_some()
        || trace.len() != 32
        || span.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let context = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    context.is_valid().then_some(context)
}

/// A span context as a `traceparent` header value.
pub fn format_traceparent(context: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        context.trace_id(),
        context.span_id(),
        context.trace_flags().to_u8()
    )
}

/// One provider call (or lookup) as a span. Its attributes name the operation, tool,
/// namespace and attempt — not the idempotency key, which may carry a customer's
/// identifiers: the operation id leads to it in the ledger.
pub struct CallSpan {
    cx: Context,
    fallback: Option<String>,
}

impl CallSpan {
    /// Starts `name` (`opgate.dispatch`, `opgate.lookup`) for an operation, under its
    /// traceparent when it has one.
    pub fn start(name: &'static str, op: &Operation, attempt: Option<Uuid>) -> Self {
        let mut attributes = vec![
            KeyValue::new("opgate.operation_id", op.operation_id.to_string()),
            KeyValue::new("opgate.tool", op.tool.clone()),
            KeyValue::new("opgate.namespace", op.namespace.clone()),
            KeyValue::new("opgate.attempt_count", i64::from(op.attempt_count)),
        ];
        if let Some(attempt) = attempt {
            attributes.push(KeyValue::new("opgate.attempt_id", attempt.to_string()));
        }
        Self::under(name, op.traceparent.as_deref(), attributes)
    }

    /// Starts `name` under a `traceparent` (a new trace without one).
    fn under(name: &'static str, traceparent: Option<&str>, attributes: Vec<KeyValue>) -> Self {
        let parent = match traceparent.and_then(parse_traceparent) {
            Some(remote) => Context::new().with_remote_span_context(remote),
            None => Context::new(),
        };
        let tracer = global::tracer("opgate");
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Client)
            .with_attributes(attributes)
            .start_with_context(&tracer, &parent);
        Self {
            cx: parent.with_span(span),
            fallback: traceparent.map(str::to_owned),
        }
    }

    /// The `traceparent` to send the provider: this span's while it is recorded, else the
    /// operation's own.
    pub fn traceparent(&self) -> Option<String> {
        let span = self.cx.span();
        if span.is_recording() && span.span_context().is_valid() {
            Some(format_traceparent(span.span_context()))
        } else {
            self.fallback.clone()
        }
    }

    /// Ends the span with what the call observed.
    pub fn end(self, outcome: &str, http_status: Option<u16>, failed: bool) {
        let span = self.cx.span();
        span.set_attribute(KeyValue::new("opgate.outcome", outcome.to_owned()));
        if let Some(status) = http_status {
            span.set_attribute(KeyValue::new(
                "http.response.status_code",
                i64::from(status),
            ));
        }
        if failed {
            span.set_status(Status::error(outcome.to_owned()));
        }
        span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No exporter installed (this test process installs none): nothing is recorded and
    /// the provider is sent the operation's own traceparent, as it is.
    #[test]
    fn without_an_exporter_the_operations_traceparent_is_passed_on() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let span = CallSpan::under("opgate.dispatch", Some(tp), Vec::new());
        assert_eq!(span.traceparent().as_deref(), Some(tp));
        span.end("committed", Some(200), false);
        let span = CallSpan::under("opgate.dispatch", None, Vec::new());
        assert_eq!(span.traceparent(), None);
        span.end("committed", None, false);
    }

    #[test]
    fn traceparents_round_trip_and_bad_ones_start_no_trace() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context = parse_traceparent(tp).expect("valid");
        assert_eq!(format_traceparent(&context), tp);
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }
}
