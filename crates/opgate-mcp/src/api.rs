//! The few admin-API calls the MCP server makes, with the caller's token: the MCP server
//! holds no ledger of its own, so whatever token an MCP session presents, opgate's API
//! decides what it may do.

use std::time::Duration;

use anyhow::{Context as _, bail};
use opgate_api::views::{ErrorAnswer, OperationView, ProposalAnswer, ToolsView};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// A client of opgate's admin API.
#[derive(Clone)]
pub(crate) struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    pub(crate) fn new(base: &str) -> anyhow::Result<Self> {
        Ok(Self {
            // Long enough for the longest `?wait=` (60 s).
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(75))
                .build()?,
            base: base.trim_end_matches('/').to_owned(),
        })
    }

    /// The tools this token may propose.
    pub(crate) async fn tools(&self, token: &str) -> anyhow::Result<ToolsView> {
        self.send(
            self.http.get(format!("{}/v1/tools", self.base)),
            token,
            false,
        )
        .await
    }

    /// Proposes; a refusal (409, 422) is an answer too.
    pub(crate) async fn propose(
        &self,
        token: &str,
        proposal: &Value,
    ) -> anyhow::Result<ProposalAnswer> {
        let request = self
            .http
            .post(format!("{}/v1/proposals", self.base))
            .json(proposal);
        self.send(request, token, true).await
    }

    /// An operation, waiting up to `wait` for it to settle.
    pub(crate) async fn operation(
        &self,
        token: &str,
        id: &str,
        wait: Duration,
    ) -> anyhow::Result<OperationView> {
        let request = self
            .http
            .get(format!("{}/v1/operations/{id}", self.base))
            .query(&[("wait", format!("{}ms", wait.as_millis()))]);
        self.send(request, token, false).await
    }

    async fn send<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        token: &str,
        refusal_is_an_answer: bool,
    ) -> anyhow::Result<T> {
        let response = request
            .bearer_auth(token)
            .send()
            .await
            .with_context(|| format!("calling opgate at {}", self.base))?;
        let status = response.status();
        let text = response.text().await?;
        if status.is_success() {
            return serde_json::from_str(&text)
                .with_context(|| format!("opgate answered {status} with an unexpected body"));
        }
        // A refused proposal is answered with its decision (other 4xx with an error).
        if refusal_is_an_answer
            && matches!(status.as_u16(), 409 | 422)
            && let Ok(answer) = serde_json::from_str(&text)
        {
            return Ok(answer);
        }
        match serde_json::from_str::<ErrorAnswer>(&text) {
            Ok(e) => bail!(
                "opgate refused ({status}, {}): {}",
                e.error.code,
                e.error.message
            ),
            Err(_) => bail!("opgate answered {status}"),
        }
    }
}
