//! The tools a model may call (names and inputs are part of the protocol), run in the
//! session's workspace `<workspace-root>/<session_id>/`.
//!
//! Promise: [`Toolbox::run`] never fails and never panics on model input. Whatever goes
//! wrong (bad input, a path leaving the workspace, a missing file, a command that fails or
//! times out) comes back as an `is_error` output for the model to read. Every output is
//! capped at [`OUTPUT_CAP`] bytes (plus a short note) and says so when it was cut.

mod bash;
pub mod checkpoint;
mod files;
pub mod guard;
mod remove;
pub mod sandbox;
mod workspace;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use agentlog_proto::v1::ToolUseBlock;
use serde::de::DeserializeOwned;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

use crate::fold::run::CallRow;

pub use checkpoint::{Checkpoints, IgnoreRules, StoreUrl};
pub use sandbox::Sandbox;
pub use workspace::Workspace;

/// The most bytes of output a tool result carries, not counting the note that says it was
/// cut.
pub const OUTPUT_CAP: usize = 64 * 1024;
/// Room for the notes a tool adds to output it cut itself.
const NOTE_ROOM: usize = 256;

/// What running a call again does to the world; decides how an interrupted call (one with
/// `tool_started` but no result) is treated on resume ([`EffectClass::on_unknown_outcome`],
/// unless `runner --on-unknown-outcome` says otherwise for the tool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EffectClass {
    /// Only looks: re-running is harmless.
    Read,
    /// Running twice leaves the same state as running once.
    Idempotent,
    /// May change the world each time: re-run only with the same idempotency key, so a
    /// downstream that honours the key collapses the duplicate.
    SideEffect,
}

impl EffectClass {
    /// What a call of this class interrupted with its outcome unknown does by default.
    pub fn on_unknown_outcome(self) -> UnknownOutcome {
        match self {
            EffectClass::Read | EffectClass::Idempotent => UnknownOutcome::Rerun,
            EffectClass::SideEffect => UnknownOutcome::RerunSameKey,
        }
    }
}

/// Which implementation runs a tool's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Implementation {
    Bash,
    ReadFile,
    WriteFile,
    EditFile,
    ListFiles,
}

/// What happens to a call whose `tool_started` is logged and whose result is not: the
/// runner that wrote it died (or lost its lease) mid-call, so nobody knows whether it took
/// effect. Decided by [`guard::next_action`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownOutcome {
    /// Run it again (as attempt + 1): harmless for a read or an idempotent write.
    Rerun,
    /// Run it again as attempt + 1 with the same idempotency key, so a downstream that
    /// honours the key collapses the duplicate.
    RerunSameKey,
    /// Never run it again: the model gets an error result saying it may or may not have
    /// taken effect.
    Report,
    /// Ask a person (`approval_requested` naming the uncertainty) before running it again.
    Ask,
}

impl FromStr for UnknownOutcome {
    type Err = String;

    fn from_str(s: &str) -> Result<UnknownOutcome, String> {
        match s {
            "rerun" => Ok(UnknownOutcome::Rerun),
            "rerun-same-key" => Ok(UnknownOutcome::RerunSameKey),
            "report" => Ok(UnknownOutcome::Report),
            "ask" => Ok(UnknownOutcome::Ask),
            other => Err(format!(
                "{other:?} is not an unknown-outcome policy (rerun, rerun-same-key, report, ask)"
            )),
        }
    }
}

/// A tool as the model sees it, plus how it behaves when repeated: the one registry of the
/// tools' names, schemas, effect classes (and so their unknown-outcome policies) and
/// implementations. A tool's name is written here and nowhere else.
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub name: &'static str,
    pub description: &'static str,
    /// JSON Schema of the input object.
    pub input_schema: Value,
    /// Decides the default for a call interrupted with its outcome unknown (the runner's
    /// `--on-unknown-outcome` overrides it).
    pub effect: EffectClass,
    implementation: Implementation,
}

/// The tools' names as a sentence: "bash, read_file, … and list_files".
pub fn tool_names() -> String {
    let names: Vec<&str> = Toolbox::specs().iter().map(|spec| spec.name).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "{flag}: there is no tool named {name:?}; the tools are {}",
        tool_names()
    )]
    UnknownTool { flag: &'static str, name: String },
    #[error("--on-unknown-outcome {0:?}: expected TOOL=POLICY, e.g. bash=report")]
    Setting(String),
    #[error("--on-unknown-outcome: {0}")]
    Policy(String),
}

/// How this runner treats calls, per tool: which need a person's yes before they run, what
/// happens to one interrupted with its outcome unknown, and which identical call in a row
/// needs a person's yes too.
#[derive(Debug, Clone, Default)]
pub struct ToolPolicy {
    approve: BTreeSet<String>,
    on_unknown_outcome: HashMap<String, UnknownOutcome>,
    /// `--repeat-limit` (0: none).
    repeat_limit: u32,
}

impl ToolPolicy {
    /// `approve`: tool names (`runner --approve`); `on_unknown_outcome`: `TOOL=POLICY`
    /// settings (`runner --on-unknown-outcome`). Names no tool has are refused.
    pub fn new(
        approve: &[String],
        on_unknown_outcome: &[String],
    ) -> Result<ToolPolicy, PolicyError> {
        let known = |flag: &'static str, name: &str| {
            if Toolbox::spec(name).is_some() {
                Ok(name.to_string())
            } else {
                Err(PolicyError::UnknownTool {
                    flag,
                    name: name.to_string(),
                })
            }
        };
        let approve = approve
            .iter()
            .map(|name| known("--approve", name.trim()))
            .collect::<Result<_, _>>()?;
        let mut overrides = HashMap::new();
        for setting in on_unknown_outcome {
            let (name, policy) = setting
                .split_once('=')
                .ok_or_else(|| PolicyError::Setting(setting.clone()))?;
            let name = known("--on-unknown-outcome", name.trim())?;
            let policy = policy.trim().parse().map_err(PolicyError::Policy)?;
            overrides.insert(name, policy);
        }
        Ok(ToolPolicy {
            approve,
            on_unknown_outcome: overrides,
            repeat_limit: 0,
        })
    }

    /// The same policy, asking a person before the `limit`-th identical call in a row
    /// (`runner --repeat-limit`; 0 never asks).
    pub fn with_repeat_limit(self, limit: u32) -> ToolPolicy {
        ToolPolicy {
            repeat_limit: limit,
            ..self
        }
    }

    /// How many identical calls in a row `call` would make after `row`, when that reaches
    /// the repeat limit (a person decides before it runs).
    pub fn repeats(&self, row: Option<&CallRow>, call: &ToolUseBlock) -> Option<u32> {
        let n = match row {
            Some(row) if row.matches(call) => row.count + 1,
            _ => 1,
        };
        (self.repeat_limit > 0 && n >= self.repeat_limit).then_some(n)
    }

    /// Whether a call of `tool` waits for a person's yes before each attempt.
    pub fn needs_approval(&self, tool: &str) -> bool {
        self.approve.contains(tool)
    }

    /// The policy for a call of `tool` interrupted with its outcome unknown. A name no tool
    /// has runs nothing (its result is an error), so running it again is harmless.
    pub fn on_unknown_outcome(&self, tool: &str) -> UnknownOutcome {
        self.on_unknown_outcome
            .get(tool)
            .copied()
            .or_else(|| Toolbox::effect_class(tool).map(EffectClass::on_unknown_outcome))
            .unwrap_or(UnknownOutcome::Rerun)
    }
}

/// The outcome of one call, as it goes into `tool_result`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    pub content: String,
    pub is_error: bool,
}

impl ToolOutput {
    fn ok(content: String) -> ToolOutput {
        ToolOutput {
            content: cap(content),
            is_error: false,
        }
    }

    fn error(content: impl Into<String>) -> ToolOutput {
        ToolOutput {
            content: cap(content.into()),
            is_error: true,
        }
    }
}

/// A call stopped before its end (its stop token fired): a bash command's whole process
/// tree was killed and reaped; there is no result to log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped;

/// The five tools, bound to a workspace root and the sandbox bash calls run in, and the
/// checkpoints of the workspaces under that root.
#[derive(Debug, Clone)]
pub struct Toolbox {
    root: PathBuf,
    sandbox: Arc<Sandbox>,
    checkpoints: Arc<Checkpoints>,
}

impl Toolbox {
    /// Tools in the workspaces under `root`, whose checkpoints leave out the default
    /// `--checkpoint-ignore` patterns.
    pub fn new(root: PathBuf, sandbox: Sandbox) -> Toolbox {
        let checkpoints = Checkpoints::new(&root, IgnoreRules::default(), sandbox.user);
        Toolbox {
            root,
            sandbox: Arc::new(sandbox),
            checkpoints: Arc::new(checkpoints),
        }
    }

    /// The same toolbox whose checkpoints leave out what `ignore` matches and live where
    /// `store` says (`runner --checkpoint-store`); the error says why that store cannot be.
    pub fn with_checkpoints(
        self,
        ignore: IgnoreRules,
        store: &StoreUrl,
        env: &[(String, String)],
    ) -> Result<Toolbox, String> {
        let checkpoints =
            Checkpoints::new(&self.root, ignore, self.sandbox.user).in_store_with(store, env)?;
        Ok(Toolbox {
            checkpoints: Arc::new(checkpoints),
            ..self
        })
    }

    /// The checkpoints of the workspaces this toolbox works in.
    pub fn checkpoints(&self) -> &Arc<Checkpoints> {
        &self.checkpoints
    }

    /// Every tool, for the model request.
    pub fn specs() -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "bash",
                description: "Run a bash command in the session's workspace directory. Returns \
                              stdout, stderr and the exit code. The environment variable \
                              IDEMPOTENCY_KEY identifies this call and stays the same if the \
                              call is retried after a crash.",
                input_schema: json!({
                    "type": "object",
                    "properties": {
                        "command": {"type": "string", "description": "The command line, run with `bash -c`."},
                        "timeout_ms": {"type": "integer", "minimum": 1, "maximum": bash::MAX_TIMEOUT_MS,
                                       "description": "Kill the command after this many milliseconds (default 120000)."}
                    },
                    "required": ["command"]
                }),
                effect: EffectClass::SideEffect,
                implementation: Implementation::Bash,
            },
            ToolSpec {
                name: "read_file",
                description: "Read a UTF-8 text file from the workspace.",
                input_schema: json!({
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "Relative to the workspace."}},
                    "required": ["path"]
                }),
                effect: EffectClass::Read,
                implementation: Implementation::ReadFile,
            },
            ToolSpec {
                name: "write_file",
                description:
                    "Create or overwrite a file in the workspace (parent directories are created).",
                input_schema: json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Relative to the workspace."},
                        "content": {"type": "string"}
                    },
                    "required": ["path", "content"]
                }),
                effect: EffectClass::Idempotent,
                implementation: Implementation::WriteFile,
            },
            ToolSpec {
                name: "edit_file",
                description:
                    "Replace the text `old`, which must occur exactly once in the file, with `new`.",
                input_schema: json!({
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "Relative to the workspace."},
                        "old": {"type": "string", "description": "Text that occurs exactly once in the file."},
                        "new": {"type": "string"}
                    },
                    "required": ["path", "old", "new"]
                }),
                effect: EffectClass::SideEffect,
                implementation: Implementation::EditFile,
            },
            ToolSpec {
                name: "list_files",
                description: "List the files under a directory of the workspace, recursively \
                              (directories end with `/`).",
                input_schema: json!({
                    "type": "object",
                    "properties": {"path": {"type": "string", "description": "Relative to the workspace; default: the workspace itself."}}
                }),
                effect: EffectClass::Read,
                implementation: Implementation::ListFiles,
            },
        ]
    }

    /// The registry entry of a tool; `None` for a name no tool has (such a call runs
    /// nothing).
    pub fn spec(name: &str) -> Option<ToolSpec> {
        Toolbox::specs().into_iter().find(|spec| spec.name == name)
    }

    /// The effect class of a tool; `None` for a name no tool has.
    pub fn effect_class(name: &str) -> Option<EffectClass> {
        Toolbox::spec(name).map(|spec| spec.effect)
    }

    /// Runs one call in `<root>/<session_id>/`. `idempotency_key` is passed to the tool
    /// (bash exports it as `IDEMPOTENCY_KEY`). When `stop` fires the call is stopped: every
    /// process a bash command started is killed and reaped before this returns
    /// `Err(Stopped)`. Dropping the future stops the call too, without waiting for that.
    pub async fn run(
        &self,
        session_id: &str,
        name: &str,
        input: Map<String, Value>,
        idempotency_key: &str,
        stop: &CancellationToken,
    ) -> Result<ToolOutput, Stopped> {
        let mut output = self
            .run_unmarked(session_id, name, input, idempotency_key, stop)
            .await?;
        if let Some(mark) = self.sandbox.mark() {
            output.content = format!("{mark}\n{}", output.content);
        }
        Ok(output)
    }

    async fn run_unmarked(
        &self,
        session_id: &str,
        name: &str,
        input: Map<String, Value>,
        idempotency_key: &str,
        stop: &CancellationToken,
    ) -> Result<ToolOutput, Stopped> {
        let workspace = match Workspace::open(&self.root, session_id, self.sandbox.user).await {
            Ok(workspace) => workspace,
            Err(e) => {
                return Ok(ToolOutput::error(format!(
                    "the workspace is unavailable: {e}"
                )))
            }
        };
        let Some(spec) = Toolbox::spec(name) else {
            return Ok(ToolOutput::error(format!(
                "there is no tool named `{name}`; the tools are {}",
                tool_names()
            )));
        };
        match spec.implementation {
            Implementation::Bash => match parse(name, input) {
                Ok(input) => {
                    bash::run(&workspace, &self.sandbox, input, idempotency_key, stop).await
                }
                Err(e) => Ok(e),
            },
            Implementation::ReadFile => {
                stoppable(
                    files::run_blocking(workspace, name, input, files::read_file),
                    stop,
                )
                .await
            }
            Implementation::WriteFile => {
                stoppable(
                    files::run_blocking(workspace, name, input, files::write_file),
                    stop,
                )
                .await
            }
            Implementation::EditFile => {
                stoppable(
                    files::run_blocking(workspace, name, input, files::edit_file),
                    stop,
                )
                .await
            }
            Implementation::ListFiles => {
                stoppable(
                    files::run_blocking(workspace, name, input, files::list_files),
                    stop,
                )
                .await
            }
        }
    }
}

/// A file tool's run, unless `stop` fires first. A file tool is a few system calls on a
/// blocking thread; a stopped one is left to finish there.
async fn stoppable(
    run: impl std::future::Future<Output = ToolOutput>,
    stop: &CancellationToken,
) -> Result<ToolOutput, Stopped> {
    tokio::select! {
        output = run => Ok(output),
        _ = stop.cancelled() => Err(Stopped),
    }
}

/// Parses a tool's input object, or says what is wrong with it.
fn parse<T: DeserializeOwned>(tool: &str, input: Map<String, Value>) -> Result<T, ToolOutput> {
    serde_json::from_value(Value::Object(input))
        .map_err(|e| ToolOutput::error(format!("invalid input for {tool}: {e}")))
}

/// Cuts `text` to [`OUTPUT_CAP`] bytes (at a character boundary) and says so, unless the
/// tool already did.
fn cap(text: String) -> String {
    if text.len() <= OUTPUT_CAP + NOTE_ROOM {
        return text;
    }
    let total = text.len();
    let mut end = OUTPUT_CAP;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let mut cut = text;
    cut.truncate(end);
    cut.push_str(&format!(
        "\n[output cut: showing the first {end} of {total} bytes]"
    ));
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_output_is_cut_and_marked() {
        let out = cap("é".repeat(OUTPUT_CAP));
        assert!(out.len() < OUTPUT_CAP + NOTE_ROOM);
        assert!(out.ends_with(&format!("of {} bytes]", 2 * OUTPUT_CAP)));
        assert_eq!(cap("short".into()), "short");
    }

    #[test]
    fn every_tool_has_an_object_schema_and_a_class() {
        for spec in Toolbox::specs() {
            assert_eq!(spec.input_schema["type"], "object", "{}", spec.name);
            assert_eq!(Toolbox::effect_class(spec.name), Some(spec.effect));
        }
        assert_eq!(Toolbox::effect_class("rm_rf"), None);
        assert_eq!(
            tool_names(),
            "bash, read_file, write_file, edit_file and list_files"
        );
    }

    #[test]
    fn the_effect_class_decides_the_default_for_an_unknown_outcome() {
        let default = ToolPolicy::default();
        for spec in Toolbox::specs() {
            assert_eq!(
                default.on_unknown_outcome(spec.name),
                spec.effect.on_unknown_outcome(),
                "{}",
                spec.name
            );
        }
        assert_eq!(
            EffectClass::SideEffect.on_unknown_outcome(),
            UnknownOutcome::RerunSameKey
        );
        assert_eq!(
            EffectClass::Read.on_unknown_outcome(),
            UnknownOutcome::Rerun
        );
        assert_eq!(
            EffectClass::Idempotent.on_unknown_outcome(),
            UnknownOutcome::Rerun
        );
    }

    #[test]
    fn the_policy_takes_registry_defaults_and_command_line_overrides() {
        let policy = ToolPolicy::new(
            &["bash".into()],
            &["bash=report".into(), "edit_file = ask".into()],
        )
        .expect("valid policy");
        assert!(policy.needs_approval("bash") && !policy.needs_approval("read_file"));
        assert_eq!(policy.on_unknown_outcome("bash"), UnknownOutcome::Report);
        assert_eq!(policy.on_unknown_outcome("edit_file"), UnknownOutcome::Ask);
        assert_eq!(
            policy.on_unknown_outcome("read_file"),
            UnknownOutcome::Rerun
        );
        let default = ToolPolicy::default();
        assert_eq!(
            default.on_unknown_outcome("bash"),
            UnknownOutcome::RerunSameKey
        );
        assert!(ToolPolicy::new(&["rm_rf".into()], &[]).is_err());
        assert!(ToolPolicy::new(&[], &["bash".into()]).is_err());
        assert!(ToolPolicy::new(&[], &["bash=maybe".into()]).is_err());
    }

    #[tokio::test]
    async fn unknown_tools_and_bad_input_are_error_results() {
        let root = tempfile::tempdir().expect("temp dir");
        let toolbox = Toolbox::new(root.path().to_path_buf(), Sandbox::unconfined_for_tests());
        let never = CancellationToken::new();
        let out = toolbox
            .run("s1", "rm_rf", Map::new(), "k", &never)
            .await
            .expect("not stopped");
        assert!(out.is_error && out.content.contains("no tool named `rm_rf`"));
        let out = toolbox
            .run("s1", "bash", Map::new(), "k", &never)
            .await
            .expect("not stopped");
        assert!(
            out.is_error && out.content.contains("missing field `command`"),
            "{out:?}"
        );
    }
}
