//! `[telemetry]`: OTLP trace export. With `otlp_endpoint` set, the spans opgate makes
//! (each provider call and lookup, in the proposing agent's trace: opgate-worker's
//! `trace` module) are batched and sent over OTLP/HTTP (protobuf) to
//! `{otlp_endpoint}/v1/traces`; without it nothing is recorded.

use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use serde::Deserialize;

/// `[telemetry]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector's OTLP/HTTP base URL, e.g. `http://otel-collector:4318` (or the full
    /// `.../v1/traces` URL).
    pub otlp_endpoint: String,
    /// `service.name` of the spans (default `opgate`).
    #[serde(default = "default_service_name")]
    pub service_name: String,
}

fn default_service_name() -> String {
    "opgate".into()
}

/// Flushes and stops the exporter when dropped (at the end of `run` or `dev`).
pub struct Telemetry(Option<SdkTracerProvider>);

/// How long stopping waits for the last spans to be exported.
const FLUSH_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl Drop for Telemetry {
    fn drop(&mut self) {
        let Some(provider) = self.0.take() else {
            return;
        };
        // The exporter's shutdown blocks until its last batch is sent (or times out
        // against an unreachable collector): wait for it on its own thread, at most
        // FLUSH_WAIT, so stopping never hangs on the collector.
        let (done, wait) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = done.send(provider.shutdown());
        });
        match wait.recv_timeout(FLUSH_WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "OTLP exporter shutdown"),
            Err(_) => {
                tracing::warn!("OTLP exporter: the last spans were not sent within {FLUSH_WAIT:?}")
            }
        }
    }
}

/// The URL spans are posted to.
pub fn traces_url(endpoint: &str) -> String {
    let endpoint = endpoint.trim_end_matches('/');
    if endpoint.ends_with("/v1/traces") {
        endpoint.to_owned()
    } else {
        format!("{endpoint}/v1/traces")
    }
}

/// Installs the exporter the config asks for (none without `[telemetry]`).
pub fn install(config: Option<&TelemetryConfig>) -> anyhow::Result<Telemetry> {
    let Some(config) = config else {
        return Ok(Telemetry(None));
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(traces_url(&config.otlp_endpoint))
        .build()
        .map_err(|e| anyhow::anyhow!("telemetry.otlp_endpoint: {e}"))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_service_name(config.service_name.clone())
                .build(),
        )
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    tracing::info!(endpoint = %traces_url(&config.otlp_endpoint), "exporting traces over OTLP");
    Ok(Telemetry(Some(provider)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_traces_path_is_added_once() {
        assert_eq!(traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            traces_url("http://c:4318/v1/traces"),
            "http://c:4318/v1/traces"
        );
    }
}
