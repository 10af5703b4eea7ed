//! The CLI's one error type and the one function that turns any error into what the operator
//! sees: a single terminal-safe, credential-redacted line and a documented exit code
//! (`docs/cli.md`).

use std::fmt;

pub(crate) use iteron_agent::Exit;
use iteron_broker::private_fs::FsError;
use iteron_broker::store::StoreError;

/// Everything a command can fail with.
#[derive(Debug)]
pub(crate) enum CliError {
    /// A bad flag or value; the text never contains the refused value.
    Usage(String),
    /// The store refused or failed.
    Store(StoreError),
    /// No server with that name (the name is not repeated: it is the operator's input).
    NotFound,
    /// The change conflicts with the configuration.
    Conflict(String),
    /// Writing the command's output failed.
    Output(std::io::Error),
    /// A server probe failed (the text is already sanitized).
    Server(String),
    /// The broker answered with an error, or could not be reached.
    Broker(iteron_broker::ipc::client::ClientError),
    /// Nothing answers on the broker socket at this path.
    NoBroker {
        /// The socket tried.
        socket: std::path::PathBuf,
        /// Why it could not be reached.
        kind: std::io::ErrorKind,
    },
    /// The broker could not start.
    Serve(String),
    /// The audit log failed verification.
    Audit(String),
}

impl From<iteron_agent::AgentError> for CliError {
    fn from(e: iteron_agent::AgentError) -> Self {
        use iteron_agent::AgentError;
        match e {
            AgentError::Usage(m) => CliError::Usage(m),
            AgentError::Output(e) => CliError::Output(e),
            AgentError::NoBroker { socket, kind } => CliError::NoBroker { socket, kind },
            AgentError::Broker(e) => CliError::Broker(e),
            AgentError::ToolReportedError => CliError::Server("the tool reported an error".into()),
        }
    }
}

impl From<StoreError> for CliError {
    fn from(e: StoreError) -> Self {
        CliError::Store(e)
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Conflict(m) => f.write_str(m),
            CliError::Store(e) => e.fmt(f),
            CliError::NotFound => {
                f.write_str("no MCP server with that name (see: iteron mcp list)")
            }
            CliError::Output(e) => write!(f, "cannot write output: {e}"),
            CliError::Server(why) | CliError::Serve(why) => f.write_str(why),
            CliError::Broker(e) => write!(f, "broker: {e}"),
            CliError::NoBroker { socket, kind } => {
                f.write_str(&iteron_agent::no_broker(socket, *kind))
            }
            CliError::Audit(why) => write!(f, "audit log verification failed: {why}"),
        }
    }
}

impl CliError {
    /// The exit code for this error. Exhaustive on purpose: a new store error forces a decision.
    pub(crate) fn exit(&self) -> Exit {
        match self {
            CliError::Usage(_) => Exit::Usage,
            CliError::NotFound => Exit::NotFound,
            CliError::Conflict(_) => Exit::Conflict,
            CliError::Output(_) => Exit::Failure,
            CliError::Server(_) => Exit::Server,
            CliError::Serve(_) => Exit::Failure,
            CliError::Audit(_) => Exit::AuditFailed,
            CliError::Broker(e) => iteron_agent::broker_exit(e),
            CliError::NoBroker { .. } => Exit::Unreachable,
            CliError::Store(e) => match e {
                StoreError::Invalid { .. }
                | StoreError::TooLarge(_)
                | StoreError::KeyringNotBuilt { .. } => Exit::InvalidConfig,
                StoreError::WouldNeedKeyring { .. } => Exit::Usage,
                StoreError::Fs(
                    FsError::NotPlain { .. }
                    | FsError::WrongOwner { .. }
                    | FsError::OpenMode { .. }
                    | FsError::HardLinked { .. },
                ) => Exit::UnsafePermissions,
                StoreError::WouldExceed => Exit::Conflict,
                StoreError::Fs(FsError::LockTimeout(_)) => Exit::Busy,
                StoreError::NoHome
                | StoreError::NotAbsolute(_)
                | StoreError::Fs(FsError::Io { .. })
                | StoreError::RoundTrip => Exit::Failure,
            },
        }
    }

    /// The one line shown on stderr: prefixed, redacted, terminal-safe, at most 512 bytes
    /// ([`iteron_agent::error_line`], shared with the agent binary).
    pub(crate) fn line(&self) -> String {
        let refusal = match self {
            CliError::Broker(e) => Some(e),
            _ => None,
        };
        iteron_agent::error_line("iteron", &self.to_string(), refusal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every exit code, in order. The match makes a new variant a compile error here until it is
    /// listed (and so documented).
    fn all_exits() -> Vec<Exit> {
        let all = [
            Exit::Ok,
            Exit::Failure,
            Exit::Usage,
            Exit::InvalidConfig,
            Exit::NotFound,
            Exit::UnsafePermissions,
            Exit::Conflict,
            Exit::Busy,
            Exit::Server,
            Exit::Refused,
            Exit::AuditFailed,
            Exit::Unreachable,
        ];
        for e in all {
            match e {
                Exit::Ok
                | Exit::Failure
                | Exit::Usage
                | Exit::InvalidConfig
                | Exit::NotFound
                | Exit::UnsafePermissions
                | Exit::Conflict
                | Exit::Busy
                | Exit::Server
                | Exit::Refused
                | Exit::AuditFailed
                | Exit::Unreachable => {}
            }
        }
        all.to_vec()
    }

    #[test]
    fn docs_cli_lists_exactly_the_exit_codes() {
        let doc = include_str!("../../docs/cli.md");
        let table = doc
            .split("<!-- exit-codes:")
            .nth(1)
            .expect("exit-code table marker");
        let documented: Vec<u8> = table
            .lines()
            .filter_map(|l| l.strip_prefix("| "))
            .filter_map(|l| l.split(' ').next()?.parse().ok())
            .collect();
        let coded: Vec<u8> = all_exits().into_iter().map(|e| e as u8).collect();
        assert_eq!(documented, coded);
    }

    #[test]
    fn a_long_broker_reason_keeps_its_certainty_and_is_not_escaped_again() {
        use iteron_broker::ipc::client::ClientError;
        // A hook reason as the broker sends it: rendered once (a backslash and an ESC), at the
        // full reason bound.
        let once = iteron_policy::text::single_line_capped("C:\\dir \u{1b}[31mred ", 300);
        let mut message = format!("blocked by an operator hook: {once}");
        while message.len() < 512 - 4 {
            message.push_str("\\x");
        }
        let e = CliError::Broker(ClientError::Refused {
            code: "refused".into(),
            message: message.clone(),
            certainty: Some("not_sent".into()),
        });
        let line = e.line();
        assert!(line.len() <= 512, "{}", line.len());
        assert!(line.ends_with("\u{2026} (effect: not_sent)"), "{line}");
        assert!(
            line.contains("C:\\\\dir \\u{1b}[31mred"),
            "escaped once: {line}"
        );
        assert!(
            !line.contains("\\\\\\\\") && !line.contains("\\\\u{1b}"),
            "escaped twice: {line}"
        );
        assert!(!line.contains('\u{1b}') && !line.contains('\n'));
        // A short one is whole, suffix included.
        let short = CliError::Broker(ClientError::Refused {
            code: "refused".into(),
            message: format!("blocked by an operator hook: {once}"),
            certainty: Some("not_sent".into()),
        });
        assert_eq!(
            short.line(),
            format!(
                "iteron: error: broker: refused: blocked by an operator hook: {once} (effect: not_sent)"
            )
        );
        // Raw text that was never rendered is still escaped.
        let raw = CliError::Usage("bad \u{1b}[2J\u{202e} value".into());
        assert_eq!(raw.line(), "iteron: error: bad \\u{1b}[2J\\u{202e} value");
    }

    #[test]
    fn error_lines_are_single_redacted_lines() {
        let e = CliError::Usage("bad\nvalue Bearer abcdefghijklmnopqrstuvwxyz0123456789".into());
        let line = e.line();
        assert!(!line.contains('\n'));
        assert!(!line.contains("abcdefghijklmnop"), "{line}");
        assert_eq!(e.exit(), Exit::Usage);
    }
}
