//! The eval's (and the demo's load run's) workload: N records over every tool of the dev
//! registry, each labelled with the business effect ("intent") it asks for, so a run can
//! be scored against the truth rather than against what opgate believes.
//!
//! A record is one of:
//! - **fresh**: a new intent;
//! - **redelivery**: a record sent again byte for byte (a producer retry, a replay);
//! - **re-spelled**: the same intent under a new event id, its arguments spelled the way
//!   a model spells them on a retry (`49` for `49.00`, ` USD `, upper-case template);
//! - **re-planned**: the same intent under a new event id with a part that is not its
//!   business identity changed (a fresh `client_order_id`, a re-run workflow, the other
//!   make-good tool on the same account);
//! - **near-duplicate**: a *new* intent one identity field away from an earlier one
//!   (49.00 vs 49.01, another entity, another template, another quantity); each is
//!   labelled with the record it resembles and must never be merged with it;
//! - **poison**: bytes that are not a proposal, or a proposal of an unknown tool.
//!
//! Intents never collide by accident: fresh intents of tools with a dedupe window or an
//! exclusive group get an entity of their own, so every merge opgate makes is one the
//! labels call for.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// What a record is, relative to the records before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A new intent.
    Fresh,
    /// An earlier record sent again, byte for byte.
    Redelivery,
    /// An earlier intent, spelled differently, under a new event id.
    Respelled,
    /// An earlier intent with a non-identity part changed, under a new event id.
    Replanned,
    /// A new intent one identity field away from an earlier one.
    NearDuplicate,
    /// Not a proposal opgate can accept.
    Poison,
}

impl Kind {
    /// The label used in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fresh => "fresh",
            Self::Redelivery => "redelivery",
            Self::Respelled => "re-spelled",
            Self::Replanned => "re-planned",
            Self::NearDuplicate => "near-duplicate",
            Self::Poison => "poison",
        }
    }
}

/// One record to publish.
#[derive(Debug, Clone)]
pub struct Record {
    /// The proposal's event id (`None` for bytes that carry none).
    pub event_id: Option<String>,
    /// The intent it asks for (`None` for poison).
    pub intent: Option<usize>,
    /// What it is.
    pub kind: Kind,
    /// The Kafka key (`{entity_type}:{entity_id}`).
    pub key: String,
    /// The value bytes.
    pub value: Vec<u8>,
    /// The tool (for the baseline and the report).
    pub tool: String,
}

/// A labelled pair that must stay two operations: (earlier event, near-duplicate event).
#[derive(Debug, Clone)]
pub struct NearPair {
    /// The earlier record's event id.
    pub original: String,
    /// The near-duplicate's event id.
    pub near: String,
    /// What differs.
    pub differs_in: &'static str,
}

/// The workload.
#[derive(Debug, Clone, Default)]
pub struct Workload {
    /// Records in publishing order.
    pub records: Vec<Record>,
    /// Distinct intents.
    pub intents: usize,
    /// The labelled near-duplicates.
    pub near_pairs: Vec<NearPair>,
}

impl Workload {
    /// Records of one kind.
    pub fn count(&self, kind: Kind) -> usize {
        self.records.iter().filter(|r| r.kind == kind).count()
    }

    /// Distinct event ids of records that are proposals (every one must be answered).
    pub fn events(&self) -> std::collections::HashSet<&str> {
        self.records
            .iter()
            .filter_map(|r| r.event_id.as_deref())
            .collect()
    }
}

/// The namespace of every eval proposal.
pub const NAMESPACE: &str = "eval";

/// An intent's first proposal, kept to derive duplicates and near-duplicates from.
#[derive(Debug, Clone)]
struct Original {
    intent: usize,
    event_id: String,
    proposal: Value,
    /// Whether a near-duplicate may still be derived from it: each fresh intent lends
    /// itself to one, so two near-duplicates never collide with each other.
    near_ok: bool,
}

/// Builds a seeded workload of `n` records.
pub fn generate(n: usize, seed: u64) -> Workload {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = Workload::default();
    let mut originals: Vec<Original> = Vec::new();
    // Shared entities for payments and orders, so one entity sees several operations.
    let shared = (n / 8).max(1);
    for i in 0..n {
        let roll: f64 = rng.random();
        let earlier = (!originals.is_empty()).then(|| rng.random_range(0..originals.len()));
        let record = match (roll, earlier) {
            (r, Some(_)) if r < 0.12 => {
                let pick = rng.random_range(0..w.records.len());
                let mut again = w.records[pick].clone();
                // A redelivered poison record is still poison.
                if again.kind != Kind::Poison {
                    again.kind = Kind::Redelivery;
                }
                again
            }
            (r, Some(o)) if r < 0.22 => {
                let o = &originals[o];
                let mut p = o.proposal.clone();
                p["event_id"] = json!(format!("ev-{i}"));
                respell(&mut p);
                record(Kind::Respelled, Some(o.intent), &p)
            }
            (r, Some(o)) if r < 0.27 => {
                let o = &originals[o];
                let mut p = o.proposal.clone();
                p["event_id"] = json!(format!("ev-{i}"));
                replan(&mut p, i);
                record(Kind::Replanned, Some(o.intent), &p)
            }
            (r, Some(o)) if r < 0.33 && originals[o].near_ok => {
                originals[o].near_ok = false;
                let o = originals[o].clone();
                let mut p = o.proposal.clone();
                p["event_id"] = json!(format!("ev-{i}"));
                let differs_in = near(&mut p, i);
                let intent = w.intents;
                w.intents += 1;
                w.near_pairs.push(NearPair {
                    original: o.event_id,
                    near: format!("ev-{i}"),
                    differs_in,
                });
                originals.push(Original {
                    intent,
                    event_id: format!("ev-{i}"),
                    proposal: p.clone(),
                    near_ok: false,
                });
                record(Kind::NearDuplicate, Some(intent), &p)
            }
            (r, _) if (0.33..0.335).contains(&r) => poison(i, &mut rng),
            _ => {
                let intent = w.intents;
                w.intents += 1;
                let p = fresh(i, intent, rng.random_range(0..shared), &mut rng);
                originals.push(Original {
                    intent,
                    event_id: format!("ev-{i}"),
                    proposal: p.clone(),
                    near_ok: true,
                });
                record(Kind::Fresh, Some(intent), &p)
            }
        };
        w.records.push(record);
    }
    w
}

fn record(kind: Kind, intent: Option<usize>, p: &Value) -> Record {
    let text = |ptr: &str| p.pointer(ptr).and_then(Value::as_str).unwrap_or_default();
    Record {
        event_id: Some(text("/event_id").to_owned()),
        intent,
        kind,
        key: format!("{}:{}", text("/entity/type"), text("/entity/id")),
        value: p.to_string().into_bytes(),
        tool: text("/tool").to_owned(),
    }
}

fn proposal(event: &str, tool: &str, entity: (&str, String), args: Value) -> Value {
    json!({"event_id": event, "namespace": NAMESPACE, "agent_id": "eval-bot", "tool": tool,
        "entity": {"type": entity.0, "id": entity.1}, "args": args})
}

const TEMPLATES: [&str; 3] = ["welcome", "receipt", "reminder"];

/// A new intent over one of the dev registry's tools. `shared` picks a shared order or
/// cart (their keys include the amount or the sku, so sharing the entity never merges
/// intents); the other tools get an entity of their own.
fn fresh(i: usize, intent: usize, shared: usize, rng: &mut StdRng) -> Value {
    let event = format!("ev-{i}");
    match rng.random_range(0..100) {
        0..35 => proposal(
            &event,
            "capture_payment",
            ("order", format!("order_{shared}")),
            // Even cents unique per intent keep two intents on one order apart (a
            // near-duplicate adds one cent: odd, so it never meets a fresh amount).
            json!({"amount": format!("{}.{:02}", 1 + intent / 50, (intent % 50) * 2), "currency": "usd"}),
        ),
        35..55 => {
            let mut p = proposal(
                &event,
                "send_email",
                ("user", format!("user_{intent}")),
                json!({"to": format!("user{intent}@example.com"), "template": TEMPLATES[rng.random_range(0..3)]}),
            );
            p["workflow_id"] = json!(format!("wf-{intent}"));
            p["step"] = json!(1);
            p
        }
        55..75 => proposal(
            &event,
            "place_order",
            ("cart", format!("cart_{shared}")),
            json!({"sku": format!("sku-{intent}"), "quantity": rng.random_range(1..4), "client_order_id": format!("ord-{i}")}),
        ),
        75..85 => {
            let mut p = proposal(
                &event,
                "create_ticket",
                ("customer", format!("cust_{shared}")),
                json!({"subject": format!("case {intent}")}),
            );
            p["workflow_id"] = json!(format!("wf-{intent}"));
            p["step"] = json!(1);
            p
        }
        85..90 => proposal(
            &event,
            "refund_payment",
            ("order", format!("order_{shared}")),
            json!({"charge_id": format!("ch_eval_{intent}")}),
        ),
        n => proposal(
            &event,
            if n < 95 {
                "issue_refund"
            } else {
                "credit_account"
            },
            ("account", format!("acct_{intent}")),
            json!({"amount": format!("{}.00", 1 + intent % 90), "currency": "eur"}),
        ),
    }
}

/// Spells the same arguments differently, as a model does on a retry.
pub fn respell(p: &mut Value) {
    let args = &mut p["args"];
    if let Some(amount) = args.get("amount").and_then(Value::as_str) {
        // "12.50" -> "12.5", "7.00" -> "7": the same money.
        let trimmed = amount
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned();
        args["amount"] = json!(trimmed);
    }
    if let Some(currency) = args.get("currency").and_then(Value::as_str) {
        args["currency"] = json!(format!(" {} ", currency.to_uppercase()));
    }
    if let Some(template) = args.get("template").and_then(Value::as_str) {
        args["template"] = json!(format!(" {}", template.to_uppercase()));
    }
    if let Some(to) = args.get("to").and_then(Value::as_str) {
        args["to"] = json!(format!("  {}", to.to_uppercase()));
    }
    if let Some(sku) = args.get("sku").and_then(Value::as_str) {
        args["sku"] = json!(format!("{} ", sku.to_lowercase()));
    }
    if let Some(charge) = args.get("charge_id").and_then(Value::as_str) {
        args["charge_id"] = json!(format!(" {charge} "));
    }
}

/// Changes a part that is not the intent's business identity.
fn replan(p: &mut Value, i: usize) {
    match p["tool"].as_str().unwrap_or_default() {
        // The agent minted a fresh order id on its retry.
        "place_order" => p["args"]["client_order_id"] = json!(format!("ord-replanned-{i}")),
        // The whole workflow was re-run: a new workflow, the same email (dedupe window).
        "send_email" => p["workflow_id"] = json!(format!("wf-rerun-{i}")),
        // The other agent reached for the other make-good tool on the same account.
        "issue_refund" => p["tool"] = json!("credit_account"),
        "credit_account" => p["tool"] = json!("issue_refund"),
        _ => respell(p),
    }
}

/// Makes a new intent one identity field away; returns what differs.
fn near(p: &mut Value, i: usize) -> &'static str {
    let tool = p["tool"].as_str().unwrap_or_default().to_owned();
    match tool.as_str() {
        "capture_payment" => {
            let amount = p["args"]["amount"].as_str().unwrap_or("1.00");
            let cents = cents(amount) + 1;
            p["args"]["amount"] = json!(format!("{}.{:02}", cents / 100, cents % 100));
            "amount (one cent more)"
        }
        "send_email" => {
            let template = p["args"]["template"].as_str().unwrap_or_default();
            let other = TEMPLATES
                .iter()
                .find(|t| **t != template)
                .copied()
                .unwrap_or("welcome");
            p["args"]["template"] = json!(other);
            p["workflow_id"] = json!(format!("wf-near-{i}"));
            "template"
        }
        "place_order" => {
            let quantity = p["args"]["quantity"].as_u64().unwrap_or(1);
            p["args"]["quantity"] = json!(quantity + 10);
            "quantity"
        }
        "create_ticket" => {
            let step = p["step"].as_u64().unwrap_or(1);
            p["step"] = json!(step + 1 + i as u64);
            "workflow step"
        }
        "refund_payment" => {
            p["args"]["charge_id"] = json!(format!("ch_eval_near_{i}"));
            "charge"
        }
        _ => {
            p["entity"]["id"] = json!(format!("acct_near_{i}"));
            "entity (another account)"
        }
    }
}

/// Minor units of a decimal amount written with at most two decimals.
fn cents(amount: &str) -> u64 {
    let (units, frac) = amount.split_once('.').unwrap_or((amount, ""));
    let frac = format!("{frac:0<2}");
    units.parse::<u64>().unwrap_or(0) * 100 + frac[..2].parse::<u64>().unwrap_or(0)
}

fn poison(i: usize, rng: &mut StdRng) -> Record {
    let (event_id, value, tool) = match rng.random_range(0..3) {
        0 => (None, format!("not json #{i}").into_bytes(), String::new()),
        1 => (
            Some(format!("ev-{i}")),
            json!({"event_id": format!("ev-{i}"), "namespace": NAMESPACE, "tool": "launch_rockets",
                "entity": {"type": "x", "id": "1"}, "args": {}})
            .to_string()
            .into_bytes(),
            "launch_rockets".to_owned(),
        ),
        // A NUL in an id: refused at decode, named, dead-lettered.
        _ => (
            None,
            format!(
                r#"{{"event_id": "ev-{i}\u0000", "namespace": "{NAMESPACE}", "tool": "capture_payment", "entity": {{"type": "order", "id": "o"}}, "args": {{"amount": "1.00", "currency": "usd"}}}}"#
            )
            .into_bytes(),
            "capture_payment".to_owned(),
        ),
    };
    Record {
        event_id,
        intent: None,
        kind: Kind::Poison,
        key: "poison".into(),
        value,
        tool,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workload_is_seeded_and_has_every_kind() {
        let a = generate(2_000, 7);
        let b = generate(2_000, 7);
        assert_eq!(a.records.len(), 2_000);
        assert!(
            a.records
                .iter()
                .zip(&b.records)
                .all(|(x, y)| x.value == y.value)
        );
        for kind in [
            Kind::Fresh,
            Kind::Redelivery,
            Kind::Respelled,
            Kind::Replanned,
            Kind::NearDuplicate,
            Kind::Poison,
        ] {
            assert!(a.count(kind) > 0, "no {kind:?} record");
        }
        assert_eq!(a.near_pairs.len(), a.count(Kind::NearDuplicate));
        let tools: std::collections::BTreeSet<_> =
            a.records.iter().map(|r| r.tool.as_str()).collect();
        for tool in [
            "capture_payment",
            "refund_payment",
            "send_email",
            "place_order",
            "create_ticket",
            "issue_refund",
            "credit_account",
        ] {
            assert!(tools.contains(tool), "no {tool} record");
        }
    }

    #[test]
    fn respelling_keeps_the_money_and_near_changes_it() {
        let mut p = proposal(
            "e",
            "capture_payment",
            ("order", "o".into()),
            json!({"amount": "12.50", "currency": "usd"}),
        );
        respell(&mut p);
        assert_eq!(p["args"]["amount"], "12.5");
        assert_eq!(cents("12.5"), 1250);
        let mut q = p.clone();
        near(&mut q, 0);
        assert_eq!(q["args"]["amount"], "12.51");
    }
}
