//! Optional producer authentication on Kafka (DESIGN.md section 9). Producers are
//! trusted through the topic's ACLs; an `[[agents]]` table with `signing_secret` makes
//! ingest also require, on that agent's records, header `opgate-signature`: the hex
//! HMAC-SHA256 of the record's value under the secret. A record without it, or with a
//! wrong one, is refused with reason `bad_signature` (a result and a DLQ entry).

use std::collections::HashMap;

use hmac::{Hmac, Mac};
use opgate_core::Registry;
use sha2::Sha256;

/// The header carrying the signature.
pub const SIGNATURE_HEADER: &str = "opgate-signature";

/// The agents whose records must be signed, with their secrets.
#[derive(Clone, Default)]
pub struct Signers(HashMap<String, Vec<u8>>);

impl std::fmt::Debug for Signers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.0.keys()).finish()
    }
}

impl Signers {
    /// The registry's `signing_secret`s with `${VAR}` expanded; an unset variable or a
    /// secret shorter than 16 bytes is a configuration error naming the agent.
    pub fn from_registry(
        registry: &Registry,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, String> {
        let mut secrets = HashMap::new();
        for (agent, written) in registry.signing_secrets() {
            let secret = opgate_core::envsubst::expand(written, &env)
                .map_err(|e| format!("agents `{agent}`: signing_secret: {e}"))?;
            if secret.len() < 16 {
                return Err(format!(
                    "agents `{agent}`: signing_secret must have at least 16 bytes"
                ));
            }
            secrets.insert(agent.to_owned(), secret.into_bytes());
        }
        Ok(Self(secrets))
    }

    /// Checks a record of `agent` (its value and its signature header): `Ok` when the
    /// agent need not sign or the signature is right, else why not.
    pub fn check(
        &self,
        agent: Option<&str>,
        value: &[u8],
        signature: Option<&str>,
    ) -> Result<(), String> {
        let Some(secret) = agent.and_then(|a| self.0.get(a)) else {
            return Ok(());
        };
        let Some(signature) = signature else {
            return Err(format!(
                "this agent's proposals must carry header `{SIGNATURE_HEADER}` (hex HMAC-SHA256 of the value)"
            ));
        };
        let given = hex::decode(signature.trim())
            .map_err(|_| format!("header `{SIGNATURE_HEADER}` is not hex"))?;
        let mut mac = mac(secret);
        mac.update(value);
        // `verify_slice` compares in constant time.
        mac.verify_slice(&given)
            .map_err(|_| format!("header `{SIGNATURE_HEADER}` does not match the value"))
    }
}

fn mac(secret: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts a key of any length.
    Hmac::<Sha256>::new_from_slice(secret)
        .unwrap_or_else(|_| unreachable!("HMAC takes any key length"))
}

/// The signature a producer puts in [`SIGNATURE_HEADER`] (hex).
pub fn sign(secret: &[u8], value: &[u8]) -> String {
    let mut mac = mac(secret);
    mac.update(value);
    hex::encode(mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signers() -> Signers {
        let registry = Registry::from_toml(
            r#"
[[tools]]
name = "t"
side_effect_class = "read"
[[agents]]
id = "signed"
tools = ["t"]
signing_secret = "${SECRET}"
[[agents]]
id = "open"
tools = ["t"]
"#,
        )
        .expect("registry");
        Signers::from_registry(&registry, |n| {
            (n == "SECRET").then(|| "0123456789abcdef".to_owned())
        })
        .expect("signers")
    }

    #[test]
    fn only_signed_agents_are_checked_and_only_the_right_signature_passes() {
        let s = signers();
        let value = br#"{"event_id":"e1"}"#;
        let good = sign(b"0123456789abcdef", value);
        assert_eq!(s.check(Some("signed"), value, Some(&good)), Ok(()));
        assert!(s.check(Some("signed"), value, None).is_err());
        assert!(s.check(Some("signed"), value, Some("zz")).is_err());
        let other_value = sign(b"0123456789abcdef", br#"{"event_id":"e2"}"#);
        assert!(s.check(Some("signed"), value, Some(&other_value)).is_err());
        let other_key = sign(b"fedcba9876543210", value);
        assert!(s.check(Some("signed"), value, Some(&other_key)).is_err());
        assert_eq!(s.check(Some("open"), value, None), Ok(()));
        assert_eq!(s.check(None, value, None), Ok(()));
    }

    #[test]
    fn an_unset_or_short_secret_is_a_config_error() {
        let registry = Registry::from_toml(
            "[[tools]]\nname = \"t\"\nside_effect_class = \"read\"\n[[agents]]\nid = \"a\"\ntools = [\"t\"]\nsigning_secret = \"${NOPE}\"",
        )
        .expect("registry");
        let err = Signers::from_registry(&registry, |_| None).expect_err("unset");
        assert!(err.contains("agents `a`"), "{err}");
        let err = Signers::from_registry(&registry, |_| Some("short".into())).expect_err("short");
        assert!(err.contains("16"), "{err}");
    }
}
