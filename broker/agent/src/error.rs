//! The agent command's one error type, the exit codes of every `iteron` command, and the one
//! function that turns an error into the line shown on stderr.

use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;

use iteron_ipc::client::ClientError;
use iteron_policy::text;

/// Exit codes, as documented in docs/cli.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Success.
    Ok = 0,
    /// An I/O or internal failure.
    Failure = 1,
    /// Bad command line (flags or argument values).
    Usage = 2,
    /// The configuration file is invalid (it was left untouched).
    InvalidConfig = 3,
    /// The named server does not exist.
    NotFound = 4,
    /// A file or directory has unsafe ownership or permissions (refused, not repaired).
    UnsafePermissions = 5,
    /// The change conflicts with the configuration (name taken, server limit reached).
    Conflict = 6,
    /// Another iteron process held the configuration lock too long.
    Busy = 7,
    /// A server could not be reached, started or understood (test, status, doctor), or a tool
    /// call failed or reported an error.
    Server = 8,
    /// The broker refused the request (unknown tool, approval required or denied, policy, hook).
    Refused = 9,
    /// The audit log failed verification.
    AuditFailed = 10,
    /// The broker socket could not be reached, or the broker broke the connection.
    Unreachable = 11,
}

impl From<Exit> for ExitCode {
    fn from(e: Exit) -> ExitCode {
        ExitCode::from(e as u8)
    }
}

/// The exit code for a broker error: the socket or the connection (11), a failed effect (8), a
/// bound or a stopping broker (7), nothing found (4), any other refusal (9).
pub fn broker_exit(e: &ClientError) -> Exit {
    match e {
        ClientError::Connect(_)
        | ClientError::WrongPeer(_)
        | ClientError::Closed
        | ClientError::Frame(_)
        | ClientError::Malformed => Exit::Unreachable,
        ClientError::Refused { code, .. } => match code.as_str() {
            "failed" => Exit::Server,
            "busy" | "shutting_down" => Exit::Busy,
            "not_found" => Exit::NotFound,
            _ => Exit::Refused,
        },
    }
}

/// Everything an agent command can fail with.
#[derive(Debug)]
pub enum AgentError {
    /// A bad flag or value; the text never contains the refused value.
    Usage(String),
    /// Writing the command's output failed.
    Output(std::io::Error),
    /// Nothing answers on the broker socket at this path.
    NoBroker {
        /// The socket tried.
        socket: PathBuf,
        /// Why it could not be reached.
        kind: std::io::ErrorKind,
    },
    /// The broker answered with an error, or broke the connection.
    Broker(ClientError),
    /// The tool ran and reported an error (its result was printed).
    ToolReportedError,
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentError::Usage(m) => f.write_str(m),
            AgentError::Output(e) => write!(f, "cannot write output: {e}"),
            AgentError::NoBroker { socket, kind } => f.write_str(&no_broker(socket, *kind)),
            AgentError::Broker(e) => write!(f, "broker: {e}"),
            AgentError::ToolReportedError => f.write_str("the tool reported an error"),
        }
    }
}

impl std::error::Error for AgentError {}

/// What is said when nothing answers on a broker socket.
pub fn no_broker(socket: &std::path::Path, kind: std::io::ErrorKind) -> String {
    format!(
        "no broker answers on {} ({kind}): start it with iteron broker serve, or give the socket \
         it listens on",
        socket.display()
    )
}

impl AgentError {
    /// The exit code (docs/cli.md).
    pub fn exit(&self) -> Exit {
        match self {
            AgentError::Usage(_) => Exit::Usage,
            AgentError::Output(_) => Exit::Failure,
            AgentError::NoBroker { .. } => Exit::Unreachable,
            AgentError::Broker(e) => broker_exit(e),
            AgentError::ToolReportedError => Exit::Server,
        }
    }

    /// The line shown on stderr for `program`.
    pub fn line(&self, program: &str) -> String {
        let refusal = match self {
            AgentError::Broker(e) => Some(e),
            _ => None,
        };
        error_line(program, &self.to_string(), refusal)
    }
}

/// The one line an error is shown as on stderr: `PROGRAM: error: …`, redacted, terminal-safe,
/// at most 512 bytes. `shown` is the error's text; `refusal` the broker error behind it, if
/// any. Parts that were rendered already (a server's error, the broker's reason) are not
/// escaped again ([`text::cap_rendered`]: only what is still unsafe is). A broker refusal's
/// certainty suffix (`(effect: not_sent)`) is kept whole: the reason before it is what is cut
/// when the line is too long.
pub fn error_line(program: &str, shown: &str, refusal: Option<&ClientError>) -> String {
    if let Some(ClientError::Refused {
        code,
        message,
        certainty: Some(c),
    }) = refusal
    {
        let suffix = text::single_line_capped(&format!(" (effect: {c})"), 64);
        let mut line = text::cap_rendered(
            &format!("{program}: error: broker: {code}: {message}"),
            text::MAX_LINE_BYTES - suffix.len(),
        );
        line.push_str(&suffix);
        return line;
    }
    text::cap_rendered(&format!("{program}: error: {shown}"), text::MAX_LINE_BYTES)
}
