//! The model providers behind one interface: stream a reply to a folded conversation,
//! passing text to a [`TextSink`] as it arrives, and return the complete
//! `AssistantMessage` exactly as the provider gave it (the proto's `AssistantMessage` is stored verbatim).
//!
//! Promise: [`Model::stream_reply`] makes one attempt and classifies its failure:
//! [`ModelError::Transient`] (429, 5xx, 529, no answer or silence past the idle timeout, a
//! cut stream, an `error` event after HTTP 200, no connection) is worth another try, with
//! why ([`FailReason`]) and the wait the provider asked for, if it did ([`wait`]);
//! [`ModelError::Unusable`] (a billing refusal, such as OpenAI's 429 `insufficient_quota`)
//! says this model will not answer, so the turn moves on to the next model of its chain;
//! [`ModelError::Refused`] (any other 4xx) ends the turn. Nothing here retries on its own:
//! the caller decides what each attempt writes to the log (`crate::resilience`).

pub mod anthropic;
mod http;
pub mod openai;
pub mod scripted;
pub mod wait;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use agentlog_proto::v1::AssistantMessage;
use tokio::sync::mpsc;

use crate::fold::transcript::{Form, JsonElements};
use crate::fold::Conversation;
use crate::tools::ToolSpec;

/// Everything a provider needs for one reply.
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'a> {
    pub system: &'a str,
    pub conversation: &'a Conversation,
    pub tools: &'a [ToolSpec],
    pub max_tokens: u32,
    /// A call that answers nothing for this long (no response, or a stream gone silent) is
    /// dropped as a failure (`--model-idle-timeout`).
    pub idle_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Worth another attempt.
    #[error("{0}")]
    Transient(Failure),
    /// A billing refusal: this model will not answer until someone pays; another might.
    #[error("{0}")]
    Unusable(String),
    /// The provider refused this request; asking again would be refused again.
    #[error("{0}")]
    Refused(String),
}

/// A failed call worth another try.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct Failure {
    pub reason: FailReason,
    pub message: String,
    /// How long the provider asked to be left alone, counted from its answer ([`wait`]).
    pub wait: Option<Duration>,
}

impl ModelError {
    fn transient(reason: FailReason, message: impl Into<String>) -> ModelError {
        ModelError::Transient(Failure {
            reason,
            message: message.into(),
            wait: None,
        })
    }
}

/// Why a call failed, as `model_retry.reason` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailReason {
    /// 529 (Anthropic), 503: the service is busy.
    Overloaded,
    /// 429.
    RateLimited,
    /// Any other 5xx, 408, or an `error` event after HTTP 200.
    ServerError,
    /// No response at all within the idle timeout.
    Timeout,
    /// The response began, then went silent past the idle timeout.
    Stalled,
    /// The stream ended (or broke) before the reply did.
    Cut,
    /// No connection.
    Unreachable,
}

impl FailReason {
    pub const ALL: [FailReason; 7] = [
        FailReason::Overloaded,
        FailReason::RateLimited,
        FailReason::ServerError,
        FailReason::Timeout,
        FailReason::Stalled,
        FailReason::Cut,
        FailReason::Unreachable,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FailReason::Overloaded => "overloaded",
            FailReason::RateLimited => "rate_limited",
            FailReason::ServerError => "server_error",
            FailReason::Timeout => "timeout",
            FailReason::Stalled => "stalled",
            FailReason::Cut => "cut",
            FailReason::Unreachable => "unreachable",
        }
    }
}

/// A `--model PROVIDER:MODEL` that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelSpecError {
    #[error("--model {0:?} names no provider; use anthropic:MODEL, openai:MODEL or scripted:FILE")]
    UnknownProvider(String),
    #[error("--model {0:?} names no model after the provider")]
    MissingModel(String),
    #[error("{0}")]
    Anthropic(#[from] anthropic::ConfigError),
    #[error("{0}")]
    OpenAi(#[from] openai::ConfigError),
    #[error("{0}")]
    Scripted(#[from] scripted::ScriptError),
    #[error("--model {0:?} is given twice")]
    Repeated(String),
    #[error("no --model given; use anthropic:MODEL, openai:MODEL or scripted:FILE")]
    None,
}

/// A session names a model its runner was not given.
#[derive(Debug, thiserror::Error)]
#[error(
    "this session runs on model {asked} (its session_config), which this runner does not have; \
     it has {has} (runner --model)"
)]
pub struct MissingModel {
    pub asked: String,
    pub has: String,
}

/// The models a runner was given (`--model`, repeatable), by their `PROVIDER:MODEL`: the
/// first is the default, and a session runs on the one its latest `session_config` names.
#[derive(Debug)]
pub struct Models {
    models: Vec<(String, Model)>,
}

impl Models {
    /// Parses every spec (see [`Model::from_spec`]); at least one, each once.
    pub fn from_specs(specs: &[String], keys: &ApiKeys) -> Result<Models, ModelSpecError> {
        let mut models: Vec<(String, Model)> = Vec::new();
        for spec in specs {
            if models.iter().any(|(known, _)| known == spec) {
                return Err(ModelSpecError::Repeated(spec.clone()));
            }
            models.push((spec.clone(), Model::from_spec(spec, keys)?));
        }
        if models.is_empty() {
            return Err(ModelSpecError::None);
        }
        Ok(Models { models })
    }

    /// One model, as the only one.
    pub fn one(spec: &str, model: Model) -> Models {
        Models {
            models: vec![(spec.to_string(), model)],
        }
    }

    /// The first `--model`.
    pub fn default_model(&self) -> &Model {
        &self.models[0].1
    }

    /// The model `asked` names (`None`: the default), or why there is none.
    pub fn get(&self, asked: Option<&str>) -> Result<&Model, MissingModel> {
        let Some(asked) = asked else {
            return Ok(self.default_model());
        };
        self.models
            .iter()
            .find(|(spec, _)| spec == asked)
            .map(|(_, model)| model)
            .ok_or_else(|| MissingModel {
                asked: asked.to_string(),
                has: self.specs().join(", "),
            })
    }

    /// The `PROVIDER:MODEL` of each model, the default first.
    pub fn specs(&self) -> Vec<&str> {
        self.models.iter().map(|(spec, _)| spec.as_str()).collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Model> {
        self.models.iter().map(|(_, model)| model)
    }

    /// The forms the models keep conversations in, each once, the default's first.
    pub fn forms(&self) -> Vec<&'static dyn Form> {
        let mut forms: Vec<&'static dyn Form> = Vec::new();
        for model in self.iter() {
            let form = model.form();
            if !forms.iter().any(|known| known.name() == form.name()) {
                forms.push(form);
            }
        }
        forms
    }
}

/// Where streamed reply text goes (the delta writer), if anywhere.
#[derive(Debug, Clone, Default)]
pub struct TextSink {
    sender: Option<mpsc::Sender<String>>,
    /// When the first text came (the time to first token).
    first_text: Arc<OnceLock<Instant>>,
}

impl TextSink {
    pub fn new(sender: mpsc::Sender<String>) -> TextSink {
        TextSink {
            sender: Some(sender),
            first_text: Arc::default(),
        }
    }

    /// Passes text on. Streamed text is a convenience for watchers, never the record (the
    /// complete reply is), so a receiver that has gone away is not an error.
    pub async fn send(&self, text: &str) {
        if text.is_empty() {
            return;
        }
        self.first_text.get_or_init(Instant::now);
        if let Some(sender) = &self.sender {
            let _ = sender.send(text.to_string()).await;
        }
    }

    pub fn first_text(&self) -> Option<Instant> {
        self.first_text.get().copied()
    }
}

/// The providers' API keys, as the runner read them at start.
#[derive(Clone, Default)]
pub struct ApiKeys {
    pub anthropic: Option<String>,
    pub openai: Option<String>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKeys(<redacted>)")
    }
}

/// The configured provider.
#[derive(Debug)]
pub enum Model {
    Anthropic(anthropic::Anthropic),
    OpenAi(openai::OpenAi),
    Scripted(scripted::Scripted),
}

impl Model {
    /// Parses `PROVIDER:MODEL`; the provider's key comes from `keys` (read at start, see
    /// `secrets`), its base URL from the environment (`ANTHROPIC_BASE_URL`, …).
    pub fn from_spec(spec: &str, keys: &ApiKeys) -> Result<Model, ModelSpecError> {
        let (provider, name) = spec
            .split_once(':')
            .ok_or_else(|| ModelSpecError::UnknownProvider(spec.to_string()))?;
        if name.is_empty() {
            return Err(ModelSpecError::MissingModel(spec.to_string()));
        }
        match provider {
            "anthropic" => Ok(Model::Anthropic(anthropic::Anthropic::new(
                name,
                keys.anthropic.clone(),
            )?)),
            "openai" => Ok(Model::OpenAi(openai::OpenAi::new(
                name,
                keys.openai.clone(),
            )?)),
            "scripted" => Ok(Model::Scripted(scripted::Scripted::load(name)?)),
            _ => Err(ModelSpecError::UnknownProvider(spec.to_string())),
        }
    }

    /// One attempt at a reply.
    pub async fn stream_reply(
        &self,
        request: ModelRequest<'_>,
        text: &TextSink,
    ) -> Result<AssistantMessage, ModelError> {
        let reply = match self {
            Model::Anthropic(model) => model.stream_reply(request, text).await,
            Model::OpenAi(model) => model.stream_reply(request, text).await,
            Model::Scripted(model) => model.stream_reply(request, text).await,
        };
        reply.map(|mut reply| {
            // Some OpenAI-compatible servers name no model: the reply says which it asked.
            if reply.model.is_empty() {
                reply.model = self.name().to_string();
            }
            reply
        })
    }

    /// The model's name as the provider knows it (for `scripted`, its `scripted:FILE`).
    pub fn name(&self) -> &str {
        match self {
            Model::Anthropic(model) => model.name(),
            Model::OpenAi(model) => model.name(),
            Model::Scripted(model) => model.name(),
        }
    }

    /// The form the provider's requests hold messages in: the fold keeps a conversation's
    /// settled messages in it, so each request renders only the messages since the last.
    pub fn form(&self) -> &'static dyn Form {
        match self {
            Model::Anthropic(_) | Model::Scripted(_) => &anthropic::FORM,
            Model::OpenAi(_) => &openai::FORM,
        }
    }

    /// The provider's name, as in `--model` (a metric label).
    pub fn provider(&self) -> &'static str {
        match self {
            Model::Anthropic(_) => "anthropic",
            Model::OpenAi(_) => "openai",
            Model::Scripted(_) => "scripted",
        }
    }
}

/// A JSON request body: the object `head` with `"messages"` added: `lead` (a system
/// message, say), then the conversation's transcript as it is, then its later messages
/// written in `form`. A transcript in another form is refused (a fold keeps the form of
/// the model it was made for, so this only guards that promise).
fn json_body(
    head: serde_json::Value,
    lead: &JsonElements,
    form: &dyn Form,
    conversation: &Conversation,
) -> Result<Vec<u8>, ModelError> {
    let transcript = &conversation.transcript;
    if transcript.form_name() != form.name() && !transcript.is_empty() {
        return Err(ModelError::Refused(format!(
            "the conversation is kept in the form {:?}, not the provider's {:?}",
            transcript.form_name(),
            form.name()
        )));
    }
    let mut later = JsonElements::default();
    for message in &conversation.messages {
        form.render(message, &mut later);
    }
    let head = serde_json::to_vec(&head).expect("a JSON value is always written to memory");
    let size = lead.as_bytes().len() + transcript.len() + later.as_bytes().len();
    let mut body = Vec::with_capacity(head.len() + size + 16);
    // `head` is an object with at least the model in it: open it again after its last member.
    body.extend_from_slice(&head[..head.len() - 1]);
    body.extend_from_slice(b",\"messages\":[");
    // A comma before every non-empty part but the first.
    let mut first = true;
    let mut separate = |body: &mut Vec<u8>| {
        if !std::mem::take(&mut first) {
            body.push(b',');
        }
    };
    if !lead.as_bytes().is_empty() {
        separate(&mut body);
        body.extend_from_slice(lead.as_bytes());
    }
    if !transcript.is_empty() {
        separate(&mut body);
        transcript.write_to(&mut body);
    }
    if !later.as_bytes().is_empty() {
        separate(&mut body);
        body.extend_from_slice(later.as_bytes());
    }
    body.extend_from_slice(b"]}");
    Ok(body)
}
