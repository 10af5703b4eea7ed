//! Lifecycle hooks: operator commands from `~/.iteron/config.json` (`hooks`: event → list of
//! absolute commands), run at `SessionStart`, `UserPromptSubmit`, `PreToolUse`, `PostToolUse`
//! and `Stop`.
//!
//! Each hook is a hardened, confined child (see [`crate::spawn`] and [`crate::confine`]:
//! environment built from nothing — only `PATH`, `LANG` and `TMPDIR`, its private scratch
//! directory —, own session, no_new_privs, no inherited descriptors, no sockets, no keyrings,
//! the operator home out of reach; the rest of the filesystem readable as its uid — `nobody`
//! under a root broker unless `hooks_run_as` says otherwise), gets the event as
//! one JSON object on stdin, and runs under a deadline ([`HOOK_TIMEOUT`]) with its output
//! bounded ([`MAX_HOOK_OUTPUT`] of stdout is read, the rest discarded; stderr is kept in the
//! spawner's bounded ring). Only a `PreToolUse` hook that exits with code 2 blocks, with its
//! stderr (terminal-safe, redacted, at most 400 bytes) as the reason. Spawn failure, timeout or
//! any other exit code is "no opinion"; every run is reported so the broker can audit it.
//!
//! Hooks run with operator authority and see live input (tool arguments, prompts): a logging
//! hook can capture what redaction hides elsewhere.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use iteron_policy::config::{AbsolutePath, HookEvent};
use iteron_policy::text;

use crate::spawn::{self, ChildSpec, Exit, child_env};

// The seam around every effect: what the daemon asks of hooks.

/// The event a tool hook sees.
#[derive(Debug, Clone)]
pub struct ToolEvent {
    /// Session id.
    pub session: String,
    /// Server.
    pub server: String,
    /// Tool.
    pub tool: String,
    /// The arguments, as the canonical JSON of an object (the bytes the operator approves and
    /// the server is sent; hooks run with operator authority and see them).
    pub arguments: Arc<str>,
}

impl ToolEvent {
    /// The arguments as a JSON object (built only when needed: a waiting call keeps bytes).
    pub fn arguments_map(&self) -> Map<String, Value> {
        match serde_json::from_str(&self.arguments) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        }
    }
}

/// What a `PreToolUse` hook decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No objection (also: no hook, a failed hook, a timed-out hook).
    NoOpinion,
    /// Block, with a reason for the agent.
    Block(String),
}

/// A boxed future.
pub type HookFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The hook seam around every effect. Hooks tighten, never widen: a hook can block a call, not
/// approve one.
pub trait ToolHooks: Send + Sync {
    /// Before approval: a verdict, and a report per hook run (for the audit log).
    fn pre_tool_use<'a>(&'a self, event: &'a ToolEvent) -> HookFuture<'a, (Verdict, Vec<Report>)>;
    /// After the effect (its outcome word).
    fn post_tool_use<'a>(
        &'a self,
        event: &'a ToolEvent,
        outcome: &'a str,
    ) -> HookFuture<'a, Vec<Report>>;
    /// `SessionStart`, `UserPromptSubmit`, `Stop`: notifications, no opinion is taken.
    fn lifecycle<'a>(&'a self, event: HookEvent, payload: Value) -> HookFuture<'a, Vec<Report>>;
}

/// No hooks configured.
pub struct NoHooks;

impl ToolHooks for NoHooks {
    fn pre_tool_use<'a>(&'a self, _: &'a ToolEvent) -> HookFuture<'a, (Verdict, Vec<Report>)> {
        Box::pin(async { (Verdict::NoOpinion, Vec::new()) })
    }
    fn post_tool_use<'a>(&'a self, _: &'a ToolEvent, _: &'a str) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async { Vec::new() })
    }
    fn lifecycle<'a>(&'a self, _: HookEvent, _: Value) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async { Vec::new() })
    }
}

/// Deadline of one hook (DESIGN §11).
pub const HOOK_TIMEOUT: Duration = Duration::from_secs(10);
/// Stdout read from one hook (DESIGN §11); the rest is discarded.
pub const MAX_HOOK_OUTPUT: usize = 64 * 1024;
/// The exit code with which a `PreToolUse` hook blocks.
pub const BLOCK_CODE: i32 = 2;

/// How one hook run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// It exited with this code (no opinion, unless a `PreToolUse` hook exited 2).
    Exited(i32),
    /// A `PreToolUse` hook blocked (exit 2), with this reason.
    Blocked(String),
    /// Killed by a signal.
    Signalled(i32),
    /// Killed at the deadline.
    TimedOut,
    /// Could not be started.
    SpawnFailed(String),
}

/// One hook run, for the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The event.
    pub event: HookEvent,
    /// The command (an operator-configured absolute path).
    pub command: String,
    /// How it ended.
    pub outcome: Outcome,
    /// Stdout bytes beyond the bound that were discarded.
    pub discarded: u64,
}

impl Report {
    /// One line for the audit record's detail.
    pub fn detail(&self) -> String {
        let how = match &self.outcome {
            Outcome::Exited(c) => format!("exit {c}, no opinion"),
            Outcome::Blocked(_) => "exit 2, blocked".to_owned(),
            Outcome::Signalled(s) => format!("signal {s}, no opinion"),
            Outcome::TimedOut => {
                format!("timed out after {} s, no opinion", HOOK_TIMEOUT.as_secs())
            }
            Outcome::SpawnFailed(why) => format!("could not start ({why}), no opinion"),
        };
        let mut s = format!("{} {}: {how}", self.event.as_str(), self.command);
        if self.discarded > 0 {
            s.push_str(&format!("; {} output bytes discarded", self.discarded));
        }
        text::single_line_capped(&s, 300)
    }
}

/// The configured hooks.
#[derive(Debug, Clone)]
pub struct HookRunner {
    hooks: BTreeMap<HookEvent, Vec<AbsolutePath>>,
    timeout: Option<Duration>,
    home: Option<std::path::PathBuf>,
    writable: Vec<std::path::PathBuf>,
    run_as: crate::confine::RunAs,
    /// Hook processes running at once, broker-wide.
    running: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Most hook processes running at once; further runs wait their turn.
pub const MAX_RUNNING_HOOKS: usize = 8;

impl HookRunner {
    /// The hooks of the operator's configuration.
    pub fn new(hooks: BTreeMap<HookEvent, Vec<AbsolutePath>>) -> HookRunner {
        HookRunner {
            hooks,
            timeout: None,
            home: None,
            writable: Vec::new(),
            run_as: crate::confine::RunAs::default(),
            running: std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_RUNNING_HOOKS)),
        }
    }

    /// Let hooks write beneath these (the configuration's `hooks_writable`), beyond their
    /// scratch directory.
    pub fn with_writable(mut self, paths: &[AbsolutePath]) -> HookRunner {
        self.writable = paths
            .iter()
            .map(|p| std::path::PathBuf::from(p.as_str()))
            .collect();
        self
    }

    /// Deny the hooks the operator home (`$ITERON_HOME`): they keep the rest of the operator's
    /// filesystem authority, but never its credentials or configuration.
    pub fn with_home(mut self, home: &std::path::Path) -> HookRunner {
        self.home = Some(home.to_path_buf());
        self
    }

    /// Who hooks run as under a root broker (the configuration's `hooks_run_as`; default
    /// `nobody`).
    pub fn with_run_as(mut self, run_as: crate::confine::RunAs) -> HookRunner {
        self.run_as = run_as;
        self
    }

    /// With another deadline (tests).
    pub fn with_timeout(mut self, timeout: Duration) -> HookRunner {
        self.timeout = Some(timeout);
        self
    }

    /// A hook's confinement: it reads the operator's filesystem except the home (Landlock, as
    /// siblings of the home) and the secrets of `/etc`, and writes only its scratch directory
    /// and `hooks_writable` (so it cannot plant code in the operator's shell files or
    /// binaries) — all as far as its uid's file modes allow; no sockets (seccomp) and a network
    /// namespace of its own with loopback down (where the system offers one), no keyrings,
    /// no capabilities, bounded open files and memory.
    fn confinement(&self) -> crate::confine::Spec {
        crate::confine::Spec {
            deny: self.home.iter().cloned().collect(),
            readable: vec![std::path::PathBuf::from("/")],
            writable: self.writable.clone(),
            network: false,
            open_files: crate::confine::DEFAULT_OPEN_FILES,
            data_bytes: crate::confine::DEFAULT_DATA_BYTES,
            processes: None,
            run_as: self.run_as,
            net_mode: crate::confine::SandboxNetwork::Namespace,
            egress: Vec::new(),
        }
    }

    /// Every configured hook that cannot run as configured, with why: its command does not
    /// exist, is not a regular file, is not executable, lies inside the operator home the hooks
    /// are denied, or (under a root broker) cannot be reached by the uid hooks run as. Such a
    /// hook has "no opinion" on every event, silently: `iteron mcp doctor` fails on it and the
    /// broker warns at start. Mode bits only (ACLs and mandatory access control are not
    /// consulted), like [`crate::confine::reachable_by`].
    pub fn problems(&self) -> Vec<HookProblem> {
        let identity = crate::confine::identity(self.run_as);
        let mut out = Vec::new();
        for (event, commands) in &self.hooks {
            for cmd in commands {
                let path = std::path::Path::new(cmd.as_str());
                let why = command_problem(path, self.home.as_deref(), &identity);
                if let Some(why) = why {
                    out.push(HookProblem {
                        event: *event,
                        command: text::single_line_capped(cmd.as_str(), 200),
                        why,
                    });
                }
            }
        }
        out
    }

    /// Whether any hook is configured for `event`.
    pub fn has(&self, event: HookEvent) -> bool {
        self.hooks.get(&event).is_some_and(|v| !v.is_empty())
    }

    /// Run every hook of `event` in order with `payload` on stdin. For `PreToolUse`, the first
    /// block stops the run (later hooks do not run).
    pub async fn run(&self, event: HookEvent, payload: &Value) -> Vec<Report> {
        let Some(commands) = self.hooks.get(&event) else {
            return Vec::new();
        };
        let input = serde_json::to_vec(payload).unwrap_or_default();
        let mut out = Vec::new();
        for cmd in commands {
            // The semaphore is never closed, so acquiring only waits for a free slot.
            let _slot = self.running.acquire().await;
            let report = run_one(
                event,
                cmd.as_str(),
                &input,
                self.timeout.unwrap_or(HOOK_TIMEOUT),
                self.confinement(),
            )
            .await;
            let blocked = matches!(report.outcome, Outcome::Blocked(_));
            out.push(report);
            if blocked {
                break;
            }
        }
        out
    }
}

/// A configured hook that cannot run (see [`HookRunner::problems`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookProblem {
    /// The event it is configured for.
    pub event: HookEvent,
    /// Its command, terminal-safe.
    pub command: String,
    /// Why it cannot run.
    pub why: String,
}

/// Why `command` cannot run as a hook, or `None`.
fn command_problem(
    command: &std::path::Path,
    home: Option<&std::path::Path>,
    identity: &Result<crate::confine::Identity, crate::confine::IdentityError>,
) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = match std::fs::metadata(command) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Some("it does not exist".to_owned());
        }
        Err(e) => {
            return Some(format!(
                "it cannot be inspected: {}",
                text::single_line_capped(&e.to_string(), 120)
            ));
        }
    };
    if !meta.is_file() {
        return Some("it is not a regular file".to_owned());
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Some("it is not executable (no x bit)".to_owned());
    }
    let real = std::fs::canonicalize(command).unwrap_or_else(|_| command.to_path_buf());
    if let Some(home) = home {
        let home_real = std::fs::canonicalize(home).unwrap_or_else(|_| home.to_path_buf());
        if real.starts_with(&home_real) {
            return Some("it lies inside $ITERON_HOME, which hooks are denied".to_owned());
        }
    }
    match identity {
        Err(e) => Some(format!("hooks cannot start: {e}")),
        Ok(id) if id.switched && !crate::confine::reachable_by(&real, id.uid, id.gid, false) => {
            Some(format!(
                "uid {} (hooks_run_as) cannot reach it by its file modes",
                id.uid
            ))
        }
        Ok(_) => None,
    }
}

/// What a blocked call's refusal says before the hook's reason.
pub const BLOCK_PREFIX: &str = "blocked by an operator hook: ";

/// The longest refusal message for a blocked call: the prefix and a reason of at most 400
/// bytes fit, and a 512-byte terminal line keeps 72 bytes for the operator CLI's framing
/// (`iteron: error: broker: refused: `) and the certainty suffix (` (effect: not_sent)`).
pub const MAX_BLOCK_MESSAGE: usize = 440;

/// The refusal message for a call a `PreToolUse` hook blocked: [`BLOCK_PREFIX`] and the reason
/// exactly as the runner rendered it (escaped once, see [`block_reason`]), capped to
/// [`MAX_BLOCK_MESSAGE`] without escaping it again. Send it with
/// [`crate::ipc::proto::Refusal::rendered`]: [`crate::ipc::proto::Refusal::new`] escapes its
/// message, which would double every backslash of the reason.
pub fn block_message(reason: &str) -> String {
    text::cap_rendered(&format!("{BLOCK_PREFIX}{reason}"), MAX_BLOCK_MESSAGE)
}

/// A blocking hook's reason from its last stderr lines (already single-line, terminal-safe and
/// redacted each): as many of the last lines as fit in 400 bytes counted from the end (the end
/// of what a hook says is its conclusion; a long line before it must not push it out). A last
/// line longer than that is cut at a character boundary. Not escaped again: escaping twice
/// would double every backslash.
fn block_reason(lines: &[String]) -> String {
    const MAX: usize = 400;
    let mut kept: Vec<&str> = Vec::new();
    let mut size = 0;
    for line in lines.iter().rev() {
        let extra = line.len() + if kept.is_empty() { 0 } else { 2 };
        if size + extra > MAX {
            if kept.is_empty() {
                let mut end = MAX;
                while !line.is_char_boundary(end) {
                    end -= 1;
                }
                kept.push(&line[..end]);
            }
            break;
        }
        size += extra;
        kept.push(line);
    }
    kept.reverse();
    kept.join("; ")
}

async fn run_one(
    event: HookEvent,
    command: &str,
    input: &[u8],
    deadline: Duration,
    confine: crate::confine::Spec,
) -> Report {
    let mut report = Report {
        event,
        command: text::single_line_capped(command, 200),
        outcome: Outcome::Exited(0),
        discarded: 0,
    };
    let (env, _) = child_env(&[], None, |_: &str| None);
    let spec = ChildSpec {
        command: command.to_owned(),
        args: Vec::new(),
        env,
        confine: Some(confine),
        egress: None,
    };
    let mut child = match spawn::spawn(spec).await {
        Ok(c) => c,
        Err(e) => {
            report.outcome = Outcome::SpawnFailed(text::single_line_capped(&e.to_string(), 200));
            return report;
        }
    };
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let mut exit = child.exit_watch();
    let work = async {
        if let Some(mut w) = stdin {
            // A hook that does not read its input may close stdin early: not an error.
            let _ = w.write_all(input).await;
            let _ = w.shutdown().await;
        }
        let mut discarded = 0u64;
        if let Some(mut r) = stdout {
            let mut kept = 0usize;
            let mut buf = vec![0u8; 8192];
            loop {
                match r.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let keep = n.min(MAX_HOOK_OUTPUT - kept);
                        kept += keep;
                        discarded += (n - keep) as u64;
                    }
                }
            }
        }
        loop {
            if let Some(e) = *exit.borrow() {
                return (e, discarded);
            }
            if exit.changed().await.is_err() {
                return (Exit::Signal(9), discarded);
            }
        }
    };
    match tokio::time::timeout(deadline, work).await {
        Ok((Exit::Code(code), discarded)) => {
            report.discarded = discarded;
            report.outcome = if code == BLOCK_CODE && event == HookEvent::PreToolUse {
                child.stderr_drained(Duration::from_secs(1)).await;
                let reason = block_reason(&child.stderr_tail(8));
                Outcome::Blocked(if reason.trim().is_empty() {
                    "no reason given".to_owned()
                } else {
                    reason
                })
            } else {
                Outcome::Exited(code)
            };
        }
        Ok((Exit::Signal(s), discarded)) => {
            report.discarded = discarded;
            report.outcome = Outcome::Signalled(s);
        }
        Err(_) => {
            report.outcome = Outcome::TimedOut;
            child.kill_group();
        }
    }
    child.shutdown(Duration::from_millis(200)).await;
    report
}

/// Builds the event objects hooks receive.
pub fn tool_payload(event: HookEvent, ev: &ToolEvent, outcome: Option<&str>) -> Value {
    let mut v = serde_json::json!({
        "event": event.as_str(),
        "session": ev.session,
        "server": ev.server,
        "tool": ev.tool,
        "arguments": Value::Object(ev.arguments_map()),
    });
    if let (Some(o), Some(obj)) = (outcome, v.as_object_mut()) {
        obj.insert("outcome".into(), o.into());
    }
    v
}

impl ToolHooks for HookRunner {
    fn pre_tool_use<'a>(&'a self, event: &'a ToolEvent) -> HookFuture<'a, (Verdict, Vec<Report>)> {
        Box::pin(async move {
            let reports = self
                .run(
                    HookEvent::PreToolUse,
                    &tool_payload(HookEvent::PreToolUse, event, None),
                )
                .await;
            let verdict = reports
                .iter()
                .find_map(|r| match &r.outcome {
                    Outcome::Blocked(why) => Some(Verdict::Block(why.clone())),
                    _ => None,
                })
                .unwrap_or(Verdict::NoOpinion);
            (verdict, reports)
        })
    }

    fn post_tool_use<'a>(
        &'a self,
        event: &'a ToolEvent,
        outcome: &'a str,
    ) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async move {
            self.run(
                HookEvent::PostToolUse,
                &tool_payload(HookEvent::PostToolUse, event, Some(outcome)),
            )
            .await
        })
    }

    fn lifecycle<'a>(&'a self, event: HookEvent, payload: Value) -> HookFuture<'a, Vec<Report>> {
        Box::pin(async move { self.run(event, &payload).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ipc::proto::{Code, Refusal};

    #[test]
    fn a_block_reason_is_escaped_once_and_leaves_room_for_the_certainty() {
        // What the spawner's ring gives: each line rendered once, a colour sequence and
        // Windows paths among them, up to 300 bytes each.
        let raw = [
            "C:\\dir\\sub \u{1b}[31mred\u{1b}[0m".to_owned(),
            "\u{202e}reversed\r and \\n literally".to_owned(),
            "x\\".repeat(50),
            "the real reason".to_owned(),
        ];
        let lines: Vec<String> = raw
            .iter()
            .map(|l| text::single_line_capped(l, 300))
            .collect();
        let reason = block_reason(&lines);
        assert!(
            reason.len() <= 400 && reason.ends_with("the real reason"),
            "{reason}"
        );
        let message = block_message(&reason);
        assert_eq!(
            message,
            format!("{BLOCK_PREFIX}{reason}"),
            "nothing is escaped again"
        );
        let refusal = Refusal::rendered(Code::Refused, &message);
        assert_eq!(refusal.message(), message, "the wire keeps it as rendered");
        // The control: the escaping constructor doubles every backslash of the reason.
        let doubled = Refusal::new(Code::Refused, &message);
        assert_ne!(doubled.message(), message);
        assert!(doubled.message().contains("\\\\u{1b}"));
        // The operator's line, framing and certainty included, stays within 512 bytes.
        let line = format!("iteron: error: broker: refused: {message} (effect: not_sent)");
        assert!(line.len() <= text::MAX_LINE_BYTES, "{}", line.len());
        // Whatever reaches it, the message is bounded and raw text is still escaped.
        let wild = block_message(&format!("{}\u{1b}[2J", "\\".repeat(600)));
        assert!(wild.len() <= MAX_BLOCK_MESSAGE && !wild.contains('\u{1b}'));
        iteron_test_support::record!(
            "P12",
            serde_json::json!({"reason_bytes": reason.len(), "line_bytes": line.len()}),
        );
    }
}
