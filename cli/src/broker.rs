//! `iteron broker …`: `broker serve` runs the daemon; `status`, `cancel`, `restart` and `stop`
//! are thin clients of its operator socket. (`iteron approvals` is in `approvals.rs`, the
//! audit and catalog views in `views.rs`, and `iteron agent` is the `iteron-agent` crate's.)

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iteron_broker::ipc::client::{ClientError, Connection};
use iteron_broker::ipc::proto::{OperatorRequest, ServerArg, StatusArg};
use iteron_broker::start::{self, StartError, StartOptions};
use iteron_broker::store::Home;
use iteron_policy::text;
use serde_json::Value;

use crate::args::{Broker, Format, OperatorSocketArg, ServeArgs};
use crate::error::CliError;

pub(crate) fn operator_socket(arg: &OperatorSocketArg) -> Result<PathBuf, CliError> {
    match &arg.operator_socket {
        Some(p) => Ok(p.clone()),
        None => Ok(start::default_operator_socket(&home()?)),
    }
}

pub(crate) fn home() -> Result<Home, CliError> {
    Home::from_env(|k| std::env::var_os(k)).map_err(CliError::from)
}

pub(crate) fn out_line(out: &mut dyn Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(CliError::Output)
}

pub(crate) fn json_out(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    crate::output::json(out, v)
}

/// `iteron broker …`
pub(crate) fn run_broker(cmd: Broker, out: &mut dyn Write) -> Result<(), CliError> {
    match cmd {
        Broker::Serve(args) => serve(args),
        Broker::Status(a) => {
            let socket = operator_socket(&a.socket)?;
            let v = operator_request(
                &socket,
                OperatorRequest::Status(StatusArg {
                    server: a.server.clone(),
                }),
            )?;
            match a.format {
                Format::Json => json_out(out, &v),
                Format::Text => status_text(out, &v),
            }
        }
        Broker::Cancel(a) => {
            let v = operator_request(
                &operator_socket(&a.socket)?,
                OperatorRequest::Cancel(ServerArg { server: a.server }),
            )?;
            let n = v.get("cancelled").and_then(Value::as_u64).unwrap_or(0);
            out_line(out, &format!("cancelled {n} call(s) in flight"))
        }
        Broker::Restart(a) => {
            operator_request(
                &operator_socket(&a.socket)?,
                OperatorRequest::Restart(ServerArg { server: a.server }),
            )?;
            out_line(
                out,
                "restarted: the catalog is cleared; the server reconnects on the next request",
            )
        }
        Broker::Stop(a) => {
            operator_request(
                &operator_socket(&a.socket)?,
                OperatorRequest::Stop(ServerArg { server: a.server }),
            )?;
            out_line(out, "stopped: the server stays down until restarted")
        }
    }
}

fn status_text(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
    let mode = if v.get("interactive").and_then(Value::as_bool) == Some(true) {
        "interactive"
    } else {
        "noninteractive"
    };
    out_line(out, &format!("broker: {mode}"))?;
    if let Some(a) = v.get("audit") {
        let state = a.get("state").and_then(Value::as_str).unwrap_or("unknown");
        let mut line = format!(
            "audit: {}",
            if state == "ok" {
                "ok".to_owned()
            } else {
                state.to_ascii_uppercase()
            }
        );
        if let Some(d) = a.get("detail").and_then(Value::as_str) {
            line.push_str(&format!(" ({})", text::single_line_capped(d, 300)));
        }
        if let Some(n) = a.get("suppressed_records").and_then(Value::as_u64)
            && n > 0
        {
            line.push_str(&format!("; {n} agent records counted, not written"));
        }
        out_line(out, &line)?;
    }
    let empty = Vec::new();
    let servers = v.get("servers").and_then(Value::as_array).unwrap_or(&empty);
    for s in servers {
        let field = |k: &str| match s.get(k) {
            Some(Value::String(x)) => text::single_line_capped(x, 200),
            Some(Value::Number(n)) => n.to_string(),
            _ => "-".into(),
        };
        let mut line = format!(
            "{}  {}  phase={}  generation={}  version={}  tools={}  in_flight={}",
            field("name"),
            field("transport"),
            field("phase"),
            field("generation"),
            field("protocol_version"),
            field("tool_count"),
            field("in_flight"),
        );
        if let Some(n) = s
            .get("egress")
            .and_then(|e| e.get("refused"))
            .and_then(Value::as_u64)
            .filter(|n| *n > 0)
        {
            let last = s
                .get("egress")
                .and_then(|e| e.get("last_refused"))
                .and_then(Value::as_str)
                .map(|l| text::single_line_capped(l, 200))
                .unwrap_or_default();
            line.push_str(&format!("  egress_refused={n} (last: {last})"));
        }
        if s.get("error").is_some_and(Value::is_string) {
            line.push_str(&format!("  error: {}", field("error")));
        }
        out_line(out, &line)?;
    }
    Ok(())
}

/// The operator's broker runs as the operator: a socket served by anyone else is refused before
/// anything is sent.
pub(crate) async fn operator_connect(socket: &Path) -> Result<Connection, ClientError> {
    Connection::connect_as(socket, nix::unistd::geteuid().as_raw()).await
}

/// A broker error as the operator reads it: a socket that cannot be reached is named, with
/// what to do about it; anything else is the broker's own answer.
pub(crate) fn via(socket: &Path) -> impl Fn(ClientError) -> CliError + '_ {
    move |e| iteron_agent::broker_error(socket, e).into()
}

pub(crate) fn operator_request(socket: &Path, request: OperatorRequest) -> Result<Value, CliError> {
    crate::rt::current_thread()?.block_on(async {
        let mut c = operator_connect(socket).await.map_err(via(socket))?;
        c.hello("iteron-cli").await.map_err(CliError::Broker)?;
        c.send(request).await.map_err(CliError::Broker)
    })
}

/// `--repo` must name a directory that exists (the broker's own check).
pub(crate) fn check_repo(repo: Option<&Path>) -> Result<(), CliError> {
    start::check_repo(repo).map_err(start_error)
}

fn serve(args: ServeArgs) -> Result<(), CliError> {
    // First, while the process still has one thread (iteron_broker::start has the whole order).
    let hardened = start::harden().map_err(start_error)?;
    // Said before the home is located, as it always was (start checks it again).
    check_repo(args.repo.as_deref())?;
    let home = home()?;
    let opts = StartOptions {
        repo: args.repo,
        agent_socket: args.socket,
        operator_socket: args.operator_socket,
        allow_uids: args.allow_uid,
        interactive: !args.noninteractive,
        approval_deadline: Duration::from_secs(args.approval_timeout),
        idle_deadline: Duration::from_secs(args.idle_timeout),
        env: Arc::new(|k: &str| std::env::var_os(k)),
    };
    let started = start::start(home, &hardened, opts, &mut |line| {
        let _ = writeln!(std::io::stderr(), "{line}");
    })
    .map_err(start_error)?;
    let interactive = started.interactive();
    // One thread: the broker's work is I/O-bound, and keeping a request's reader, handler and
    // writer on one thread saves a cross-thread wake-up per frame (measured: refused round trip
    // 86 → 73 µs at p50). Blocking work (keyring, credential files) goes to the blocking pool;
    // children are forked by the spawner's own thread.
    let rt = crate::rt::current_thread()?;
    rt.block_on(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Without signal handling the broker could not stop cleanly: refuse to run. SIGHUP
        // (the terminal it ran in went away) stops it the same way: the default action would
        // kill it without its broker_stop record and leave both sockets behind.
        let (mut term, mut int, mut hup) = match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) {
            (Ok(t), Ok(i), Ok(h)) => (t, i, h),
            _ => {
                return Err(CliError::Serve(
                    "cannot install the SIGTERM/SIGINT/SIGHUP handlers".into(),
                ));
            }
        };
        let stop = async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
                _ = hup.recv() => {},
            }
        };
        started
            .serve(stop, |ready| {
                let _ = writeln!(
                    std::io::stderr(),
                    "{}",
                    text::single_line(&format!(
                        "iteron broker: ready; agent socket {}, operator socket {}, {}",
                        ready.agent_socket.display(),
                        ready.operator_socket.display(),
                        if interactive {
                            "interactive"
                        } else {
                            "noninteractive"
                        }
                    ))
                );
            })
            .await
            .map_err(start_error)
    })
}

/// A start-up error as the CLI reports it: bad options are usage errors (exit 2), an
/// unreadable configuration exits as every configuration error does, the rest are serve
/// failures.
fn start_error(e: StartError) -> CliError {
    match e {
        StartError::Options(why) => CliError::Usage(why.into()),
        StartError::Config(e) => CliError::Store(e),
        e @ (StartError::Harden(_) | StartError::UnitSecrets(_) | StartError::Serve(_)) => {
            CliError::Serve(e.to_string())
        }
    }
}
