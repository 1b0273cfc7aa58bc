//! The adapters of every registered tool, built once from the registry.

use std::collections::HashMap;
use std::sync::Arc;

use opgate_core::Registry;
use opgate_tools::http::BuildError;
use opgate_tools::{HttpAdapter, ToolAdapter};

/// Tool name -> adapter.
#[derive(Clone, Default)]
pub struct Adapters {
    by_tool: HashMap<String, Arc<dyn ToolAdapter>>,
}

impl Adapters {
    /// HTTP adapters for every tool that declares `[tools.adapter]`; `${ENV}` is expanded
    /// with `env`.
    pub fn from_registry(
        registry: &Registry,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, BuildError> {
        let mut by_tool: HashMap<String, Arc<dyn ToolAdapter>> = HashMap::new();
        for tool in registry.tools().filter(|t| t.adapter.is_some()) {
            by_tool.insert(tool.name.clone(), Arc::new(HttpAdapter::new(tool, &env)?));
        }
        Ok(Self { by_tool })
    }

    /// Adds or replaces one adapter (tests use fault-injecting ones).
    pub fn insert(&mut self, tool: impl Into<String>, adapter: Arc<dyn ToolAdapter>) {
        self.by_tool.insert(tool.into(), adapter);
    }

    /// The adapter of a tool.
    pub fn get(&self, tool: &str) -> Option<&Arc<dyn ToolAdapter>> {
        self.by_tool.get(tool)
    }
}
