//! Outside clients of opgate, as agents and their providers see it.
//!
//! - [`workload`]: a seeded, labelled workload over every tool of the dev registry
//!   (fresh intents, redeliveries, re-spelled and re-planned duplicates, near-duplicates
//!   that must stay apart, poison) — the demo's load run and the eval share it;
//! - [`demo`]: `opgate dev --demo`, the scripted incidents from the field, then a load run;
//! - [`eval`]: `opgate eval`, the seeds' KPIs for opgate and for [`baseline`], a naive
//!   at-least-once consumer that calls the providers directly;
//! - [`observe`]: the results and DLQ reader every client here uses;
//! - [`client`]: publishing records and waiting for results, for the benchmarks.
//!
//! This crate and opgate-kafka are the only ones that speak Kafka.
#![forbid(unsafe_code)]

pub mod baseline;
pub mod client;
pub mod demo;
pub mod eval;
pub mod observe;
pub mod progress;
pub mod workers;
pub mod workload;
