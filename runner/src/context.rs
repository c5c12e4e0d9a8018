//! What the guarded loop (`turn.rs`) and its model step (`call_model.rs`) share across a
//! runner's sessions: the models, the tools, their settings, the circuits, the prompt.

use crate::model::Models;
use crate::resilience::circuit::Circuits;
use crate::resilience::Settings;
use crate::tools::{ToolPolicy, ToolSpec, Toolbox};

/// The system prompt every model call carries.
pub const SYSTEM_PROMPT: &str = "You are an agent working in a private workspace directory. \
Use the tools to inspect and change files and to run commands there; paths are relative to \
the workspace. Finish with a short summary of what you did.";

/// What the loop needs besides the session: the models, the tools, and their settings.
#[derive(Debug)]
pub struct TurnContext {
    /// The runner's models; a session runs on the one its `session_config` names.
    pub models: Models,
    pub toolbox: Toolbox,
    pub tools: Vec<ToolSpec>,
    /// Which calls wait for a person, and what an unknown outcome does, per tool.
    pub policy: ToolPolicy,
    pub max_tokens: u32,
    /// What the runner does when the work keeps failing (its flags).
    pub settings: Settings,
    /// Each model's circuit, across the runner's sessions.
    pub circuits: Circuits,
}
