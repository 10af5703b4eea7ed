//! `iteron broker …`, `iteron approvals …`, `iteron agent …` and `iteron audit verify`.
//!
//! `broker serve` runs the daemon; the others are thin clients of its two sockets. The agent
//! commands need nothing but the agent socket's path: they never read `ITERON_HOME`.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use iteron_agent::parse_object;
use iteron_broker::approvals::MAX_PREVIEW;
use iteron_broker::ipc::client::{ClientError, Connection};
use iteron_broker::ipc::proto::{
    Answer, Decide, FormAction, OperatorRequest, PendingArg, ServerArg, Show, StatusArg,
};
use iteron_broker::start::{self, StartError, StartOptions};
use iteron_broker::store::Home;
use iteron_policy::text;
use serde_json::{Map, Value, json};

use crate::args::{
    Approvals, ApprovalsArgs, Audit, Broker, CatalogArgs, Format, OperatorSocketArg, ServeArgs,
    ShowArgs,
};
use crate::error::CliError;

fn operator_socket(arg: &OperatorSocketArg) -> Result<PathBuf, CliError> {
    match &arg.operator_socket {
        Some(p) => Ok(p.clone()),
        None => Ok(start::default_operator_socket(&home()?)),
    }
}

fn home() -> Result<Home, CliError> {
    Home::from_env(|k| std::env::var_os(k)).map_err(CliError::from)
}

fn out_line(out: &mut dyn Write, line: &str) -> Result<(), CliError> {
    writeln!(out, "{line}").map_err(CliError::Output)
}

fn json_out(out: &mut dyn Write, v: &Value) -> Result<(), CliError> {
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
async fn operator_connect(socket: &Path) -> Result<Connection, ClientError> {
    Connection::connect_as(socket, nix::unistd::geteuid().as_raw()).await
}

/// A broker error as the operator reads it: a socket that cannot be reached is named, with
/// what to do about it; anything else is the broker's own answer.
fn via(socket: &Path) -> impl Fn(ClientError) -> CliError + '_ {
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
fn check_repo(repo: Option<&Path>) -> Result<(), CliError> {
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

/// `iteron approvals …`
pub(crate) fn run_approvals(args: ApprovalsArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let socket = operator_socket(&args.socket)?;
    match args
        .action
        .unwrap_or(Approvals::List(crate::args::FormatArg {
            format: Format::Text,
        })) {
        Approvals::List(f) => {
            let v = operator_request(&socket, OperatorRequest::Pending(PendingArg::default()))?;
            match f.format {
                Format::Json => json_out(out, &v),
                Format::Text => {
                    let empty = Vec::new();
                    let items = v.get("pending").and_then(Value::as_array).unwrap_or(&empty);
                    if items.is_empty() {
                        return out_line(out, "nothing is waiting");
                    }
                    for item in items {
                        out_line(out, &describe_item(item))?;
                    }
                    Ok(())
                }
            }
        }
        Approvals::Approve(a) => decide(&socket, &a.ids, a.sha256.as_deref(), true, out),
        Approvals::Deny(a) => decide(&socket, &a.ids, a.sha256.as_deref(), false, out),
        Approvals::Rules(cmd) => crate::rules::run(cmd, out),
        Approvals::Answer(a) => {
            let (action, content) = if a.decline {
                (FormAction::Decline, Map::new())
            } else if a.cancel {
                (FormAction::Cancel, Map::new())
            } else {
                let raw = a.json.ok_or_else(|| {
                    CliError::Usage("give --json OBJECT, --decline or --cancel".into())
                })?;
                (
                    FormAction::Accept,
                    parse_object(&raw)
                        .ok_or_else(|| CliError::Usage("--json must be a JSON object".into()))?,
                )
            };
            operator_request(
                &socket,
                OperatorRequest::Answer(Answer {
                    id: a.id,
                    action,
                    content,
                }),
            )?;
            out_line(out, &format!("answered {}", a.id))
        }
        Approvals::Show(a) => show(&socket, &a, out),
        Approvals::Watch => watch(&socket, out),
    }
}

/// Most bytes of arguments `approvals show` puts together. The broker's own bounds (the frame,
/// the nodes in it) keep real arguments far below; this only stops a broken broker.
const MAX_SHOWN_ARGUMENTS: usize = 16 << 20;

/// One waiting call, whole: its arguments are fetched in as many `show` answers as they take,
/// checked against the audited digest, and printed complete, terminal-safe (JSON escapes for
/// what a terminal would act on) and unredacted.
fn show(socket: &Path, a: &ShowArgs, out: &mut dyn Write) -> Result<(), CliError> {
    let broken = || CliError::Broker(ClientError::Malformed);
    let (head, full) = crate::rt::current_thread()?.block_on(async {
        let mut c = operator_connect(socket).await.map_err(via(socket))?;
        c.hello("iteron-cli").await.map_err(CliError::Broker)?;
        let mut full = String::new();
        loop {
            let part = c
                .send(OperatorRequest::Show(Show {
                    id: a.id,
                    offset: full.len(),
                }))
                .await
                .map_err(CliError::Broker)?;
            let total = part.get("arguments_bytes").and_then(Value::as_u64);
            let chunk = part.get("arguments").and_then(Value::as_str);
            let (Some(total), Some(chunk)) = (total, chunk) else {
                return Err(broken());
            };
            if part.get("offset").and_then(Value::as_u64) != Some(full.len() as u64)
                || total > MAX_SHOWN_ARGUMENTS as u64
                || full.len() + chunk.len() > total as usize
            {
                return Err(broken());
            }
            full.push_str(chunk);
            match part.get("next_offset").and_then(Value::as_u64) {
                Some(next) if next == full.len() as u64 && !chunk.is_empty() => {}
                None if full.len() as u64 == total => return Ok((part, full)),
                _ => return Err(broken()),
            }
        }
    })?;
    let field = |k: &str| head.get(k).and_then(Value::as_str).unwrap_or("-");
    let digest = field("args_sha256");
    if iteron_broker::audit::sha256_hex(full.as_bytes()) != digest {
        return Err(CliError::Server(
            "the arguments the broker showed do not match their audited SHA-256; deny the call"
                .into(),
        ));
    }
    let arguments: Value = serde_json::from_str(&full).map_err(|_| broken())?;
    if let Format::Json = a.format {
        return json_out(
            out,
            &json!({
                "id": a.id,
                "session": head.get("session"),
                "peer_uid": head.get("peer_uid"),
                "peer_pid": head.get("peer_pid"),
                "server": head.get("server"),
                "tool": head.get("tool"),
                "args_sha256": digest,
                "arguments_bytes": full.len(),
                "arguments": arguments,
            }),
        );
    }
    let number = |k: &str| {
        head.get(k)
            .and_then(Value::as_u64)
            .map_or_else(|| "-".to_owned(), |n| n.to_string())
    };
    // Not redacted (the operator must see what is approved; a digest would look like a secret),
    // only made terminal-safe.
    for line in [
        format!("[{}] call {}/{}", a.id, field("server"), field("tool")),
        format!(
            "from uid {} pid {} (session {})",
            number("peer_uid"),
            number("peer_pid"),
            field("session")
        ),
        format!("args_sha256 {digest} (checked against the arguments below)"),
        format!(
            "arguments, {} bytes of canonical JSON, whole (what a terminal would act on is JSON-escaped):",
            full.len()
        ),
    ] {
        out_line(out, &text::escape_capped(&line, 1024))?;
    }
    out_line(out, &text::terminal_safe_json(&arguments, true))
}

/// Approve or deny waiting calls by id (and, for one, its argument digest). One id that is
/// not waiting exits 4 (as it always has); with several, those not waiting are named and the
/// command exits 4 if any was missing.
fn decide(
    socket: &Path,
    ids: &[u64],
    sha256: Option<&str>,
    approve: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let word = if approve { "approved" } else { "denied" };
    let one = |id: u64, args_sha256: Option<String>| Decide {
        id: Some(id),
        ids: Vec::new(),
        approve,
        args_sha256,
    };
    let request = match (ids, sha256) {
        ([id], Some(d)) => {
            if iteron_policy::rules::Sha256Hex::parse(d).is_none() {
                return Err(CliError::Usage(
                    "--sha256 must be 64 lowercase hex digits".into(),
                ));
            }
            one(*id, Some(d.to_owned()))
        }
        (_, Some(_)) => {
            return Err(CliError::Usage(
                "--sha256 names one call: give exactly one id with it".into(),
            ));
        }
        ([id], None) => one(*id, None),
        (many, None) => Decide {
            id: None,
            ids: many.to_vec(),
            approve,
            args_sha256: None,
        },
    };
    let v = operator_request(socket, OperatorRequest::Decide(request))?;
    let list = |k: &str| -> Vec<u64> {
        v.get(k)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default()
    };
    for id in list("decided") {
        out_line(out, &format!("{word} {id}"))?;
    }
    let missing = list("not_found");
    if !missing.is_empty() {
        let shown: Vec<String> = missing.iter().map(u64::to_string).collect();
        return Err(CliError::Broker(
            iteron_broker::ipc::client::ClientError::Refused {
                code: "not_found".into(),
                message: format!("not waiting: {}", shown.join(", ")),
                certainty: None,
            },
        ));
    }
    Ok(())
}

fn describe_item(item: &Value) -> String {
    let s = |k: &str| {
        item.get(k)
            .and_then(Value::as_str)
            .unwrap_or("-")
            .to_owned()
    };
    let id = item.get("id").and_then(Value::as_u64).unwrap_or(0);
    if s("kind") != "call" {
        let during: Vec<String> = item
            .get("during")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{} for uid {} (session {})",
                    c.get("tool").and_then(Value::as_str).unwrap_or("-"),
                    c.get("peer_uid").and_then(Value::as_u64).unwrap_or(0),
                    c.get("session").and_then(Value::as_str).unwrap_or("-"),
                )
            })
            .collect();
        let line = format!(
            "[{id}] form from {} during {}: {} (schema {})",
            s("server"),
            if during.is_empty() {
                "no call".to_owned()
            } else {
                during.join(", ")
            },
            s("message"),
            item.get("schema").map(Value::to_string).unwrap_or_default()
        );
        return text::escape_capped(&line, 8192);
    }
    // Not redacted: the operator must see what is approved.
    let head = text::escape_capped(
        &format!(
            "[{id}] call {}/{} from uid {} (session {}) arguments ",
            s("server"),
            s("tool"),
            item.get("peer_uid").and_then(Value::as_u64).unwrap_or(0),
            s("session"),
        ),
        1024,
    );
    // The broker's preview is terminal-safe and bounded already: shown as it is (escaping it
    // again would double its backslashes). Anything else is escaped and cut here.
    let preview = item.get("arguments").and_then(Value::as_str).unwrap_or("");
    let (shown, cut_here) =
        if preview.len() <= MAX_PREVIEW && text::check_untrusted(preview, false).is_ok() {
            (preview.to_owned(), false)
        } else {
            let c = text::escape_capped_counted(preview, MAX_PREVIEW);
            let cut = c.is_cut();
            (c.text, cut)
        };
    // The notice comes after the preview and is never cut; without the broker's count the
    // preview is taken to be cut.
    let notice = match item.get("arguments_omitted").and_then(Value::as_u64) {
        Some(0) if !cut_here => String::new(),
        Some(n) if !cut_here => format!(" ({n} bytes not shown; iteron approvals show {id})"),
        _ => format!(" (cut; iteron approvals show {id})"),
    };
    format!("{head}{shown}{notice}")
}

/// Longest answer line `watch` reads (a form's JSON content); a longer one is refused.
const MAX_ANSWER_LINE: usize = 64 * 1024;

/// Read one answer line from the terminal, byte by byte straight from the descriptor: nothing
/// is read ahead into a buffer, so what the operator types later stays in the terminal's queue
/// until [`discard_type_ahead`] drops it. `None` at end of input; an over-long line is `Some`
/// empty (refused).
fn read_answer(fd: std::os::fd::BorrowedFd<'_>) -> Result<Option<String>, CliError> {
    let mut line = Vec::new();
    let mut too_long = false;
    loop {
        let mut byte = [0u8; 1];
        match nix::unistd::read(fd, &mut byte) {
            Ok(0) if line.is_empty() && !too_long => return Ok(None),
            Ok(0) => break,
            Ok(_) if byte[0] == b'\n' => break,
            Ok(_) if line.len() < MAX_ANSWER_LINE => line.push(byte[0]),
            Ok(_) => too_long = true,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(CliError::Output(std::io::Error::from(e))),
        }
    }
    if too_long {
        return Ok(Some(String::new()));
    }
    Ok(Some(String::from_utf8_lossy(&line).into_owned()))
}

/// Drop whatever was typed before now (`tcflush(TCIFLUSH)`): an answer counts only when it was
/// typed after the item it answers was on the screen.
fn discard_type_ahead(fd: std::os::fd::BorrowedFd<'_>) -> Result<(), CliError> {
    nix::sys::termios::tcflush(fd, nix::sys::termios::FlushArg::TCIFLUSH)
        .map_err(|e| CliError::Output(std::io::Error::from(e)))
}

/// How often `watch`, while nothing new waits, looks whether the input has ended.
const WATCH_INPUT_POLL: Duration = Duration::from_millis(250);

/// How long one `pending` long-poll of `approvals watch` waits for something new.
const WATCH_PENDING_WAIT_MS: u64 = 1000;

/// Whether the terminal's input ended while nothing was being asked (`Ctrl-D` on an empty
/// line, or the terminal hung up), waiting at most `wait` for it. A line typed meanwhile
/// answers nothing: it is read and dropped here (it would be discarded before the next prompt
/// anyway).
fn input_ended(fd: std::os::fd::BorrowedFd<'_>, wait: Duration) -> Result<bool, CliError> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(0) | Err(nix::errno::Errno::EINTR) => return Ok(false),
        Ok(_) => {}
        Err(e) => return Err(CliError::Output(std::io::Error::from(e))),
    }
    let revents = fds[0].revents().unwrap_or(PollFlags::empty());
    if revents.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL)
        && !revents.contains(PollFlags::POLLIN)
    {
        return Ok(true);
    }
    let mut buf = [0u8; 4096];
    match nix::unistd::read(fd, &mut buf) {
        Ok(0) | Err(nix::errno::Errno::EIO) => Ok(true),
        Ok(_) | Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => Ok(false),
        Err(e) => Err(CliError::Output(std::io::Error::from(e))),
    }
}

/// What `watch` says when the input ends: nothing is decided on the operator's behalf, and
/// what it leaves waiting is named.
fn watch_ended(out: &mut dyn Write, left: &[u64]) -> Result<(), CliError> {
    out_line(out, "")?;
    if left.is_empty() {
        return out_line(out, "end of input: stopped; nothing was left half-decided");
    }
    let ids: Vec<String> = left.iter().map(u64::to_string).collect();
    out_line(
        out,
        &format!(
            "end of input: stopped; left waiting, undecided: {} (iteron approvals list)",
            ids.join(", ")
        ),
    )
}

fn watch(socket: &Path, out: &mut dyn Write) -> Result<(), CliError> {
    let stdin = std::io::stdin();
    let fd = stdin.as_fd();
    // Input that does not come from a terminal cannot be told apart from type-ahead (`yes |`
    // would approve what nobody saw), so it is refused.
    if !nix::unistd::isatty(fd).unwrap_or(false) {
        return Err(CliError::Usage(
            "approvals watch takes its answers from a terminal and stdin is not one; use iteron approvals list and approve/deny ID".into(),
        ));
    }
    let rt = crate::rt::current_thread()?;
    let mut conn = rt.block_on(async {
        let mut c = operator_connect(socket).await.map_err(via(socket))?;
        c.hello("iteron-approvals")
            .await
            .map_err(CliError::Broker)?;
        Ok::<_, CliError>(c)
    })?;
    let mut asked = std::collections::HashSet::new();
    out_line(out, "waiting for calls and forms (end input to stop)")?;
    loop {
        let v = rt
            .block_on(conn.send(OperatorRequest::Pending(PendingArg {
                wait_ms: WATCH_PENDING_WAIT_MS,
            })))
            .map_err(CliError::Broker)?;
        let empty = Vec::new();
        let items = v.get("pending").and_then(Value::as_array).unwrap_or(&empty);
        let nothing_new = items.iter().all(|i| {
            i.get("id")
                .and_then(Value::as_u64)
                .is_none_or(|id| asked.contains(&id))
        });
        // While nothing new waits, the end of input is noticed here (not only at a prompt);
        // without anything new, this wait is also what keeps the loop from spinning.
        let wait = if nothing_new {
            WATCH_INPUT_POLL
        } else {
            Duration::ZERO
        };
        if input_ended(fd, wait)? {
            return watch_ended(out, &[]);
        }
        for (n, item) in items.iter().enumerate() {
            let Some(id) = item.get("id").and_then(Value::as_u64) else {
                continue;
            };
            if !asked.insert(id) {
                continue;
            }
            out_line(out, &describe_item(item))?;
            let form = item.get("kind").and_then(Value::as_str) == Some("form");
            let prompt = if form {
                "answer with a JSON object, or an empty line to decline: "
            } else {
                "approve? [y/N] "
            };
            write!(out, "{prompt}").map_err(CliError::Output)?;
            out.flush().map_err(CliError::Output)?;
            // The item and its prompt are on the screen: only what is typed from now on answers.
            discard_type_ahead(fd)?;
            let Some(line) = read_answer(fd)? else {
                // Nothing is sent for this item or any after it: each stays waiting, whole.
                let left: Vec<u64> = items[n..]
                    .iter()
                    .filter_map(|i| i.get("id").and_then(Value::as_u64))
                    .filter(|i| *i == id || !asked.contains(i))
                    .collect();
                return watch_ended(out, &left);
            };
            let line = line.trim();
            let request = if form {
                let (action, content) = match parse_object(line) {
                    Some(content) if !line.is_empty() => (FormAction::Accept, content),
                    _ => (FormAction::Decline, Map::new()),
                };
                OperatorRequest::Answer(Answer {
                    id,
                    action,
                    content,
                })
            } else {
                OperatorRequest::Decide(Decide {
                    id: Some(id),
                    ids: Vec::new(),
                    approve: matches!(line, "y" | "Y" | "yes"),
                    args_sha256: None,
                })
            };
            match rt.block_on(conn.send(request)) {
                Ok(_) => out_line(out, "sent")?,
                // An answer that does not fit the form leaves it waiting: ask it again.
                Err(e @ ClientError::Refused { .. }) if form => {
                    out_line(out, &text::single_line(&format!("not sent: {e}")))?;
                    asked.remove(&id);
                }
                Err(e) => out_line(out, &text::single_line(&format!("not sent: {e}")))?,
            }
        }
    }
}

/// `iteron audit verify [--expect SEQ:SHA256]...`
pub(crate) fn run_audit(cmd: Audit, out: &mut dyn Write) -> Result<(), CliError> {
    use iteron_broker::audit::{MAX_PINS, Pin};
    let f = match cmd {
        Audit::Verify(f) => f,
        Audit::Rules(f) => return crate::rules::audit_rules(f.format, out),
    };
    if f.expect.len() > MAX_PINS {
        return Err(CliError::Usage(format!(
            "--expect is given at most {MAX_PINS} times"
        )));
    }
    let pins = f
        .expect
        .iter()
        .map(|p| Pin::parse(p).map_err(|why| CliError::Usage(format!("--expect: {why}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let home = home()?;
    let v = match iteron_broker::audit::verify(home.dir(), &pins) {
        Ok(v) => v,
        Err(t) => {
            // JSON callers get the failure as JSON too (and the one line on stderr, exit 10).
            if f.format == Format::Json {
                json_out(
                    out,
                    &json!({
                        "ok": false,
                        "error": text::single_line_capped(&t.why, 400),
                        "file": t.file,
                        "line": t.line,
                    }),
                )?;
            }
            return Err(CliError::Audit(t.to_string()));
        }
    };
    let pin = |p: &Option<Pin>| p.as_ref().map(Pin::to_string);
    // Nothing written yet and no anchor naming a record: no broker has run with this home.
    let no_log = v.files == 0 && v.records == 0 && v.anchor.is_none() && v.expected == 0;
    if f.format == Format::Json {
        return json_out(
            out,
            &json!({
                "ok": true,
                "log": if no_log { "none" } else { "present" },
                "records": v.records,
                "files": v.files,
                "head": v.newest.as_ref().map_or(iteron_broker::audit::GENESIS, |p| p.sha256.as_str()),
                "head_seq": v.newest.as_ref().map(|p| p.seq),
                "pin": pin(&v.newest),
                "being_written": v.being_written,
                "adopted": v.adopted,
                "anchor": pin(&v.anchor),
                "expected": v.expected,
            }),
        );
    }
    if no_log {
        return out_line(
            out,
            "no audit log yet: no broker has run with this home, so there is nothing to verify (a log removed together with its audit-anchor would look the same: pin records with --expect)",
        );
    }
    out_line(
        out,
        &format!(
            "audit log verified: {} records in {} files; newest record {}",
            v.records,
            v.files,
            pin(&v.newest).unwrap_or_else(|| "none".into())
        ),
    )?;
    match &v.anchor {
        Some(a) => out_line(
            out,
            &format!("anchor: record {} matches audit-anchor", a.seq),
        )?,
        None => out_line(
            out,
            "note: there is no audit-anchor (a log removed together with it would not be noticed; pin the newest record with --expect)",
        )?,
    }
    if v.expected > 0 {
        out_line(out, &format!("expected: {} records match", v.expected))?;
    }
    for seq in &v.adopted {
        out_line(
            out,
            &format!(
                "note: record {seq} was adopted at a broker start without its head: a broker killed between writing it and its head, or a record someone else appended (see record {})",
                seq + 1
            ),
        )?;
    }
    if v.being_written > 0 {
        out_line(
            out,
            &format!(
                "note: {} records after the head were still being written by the running broker",
                v.being_written
            ),
        )?;
    }
    Ok(())
}

/// The audit log's state for `iteron mcp doctor`: a running broker's own answer (`ok`, `failed`
/// or `low_space`), else what a broker starting now would find on disk.
pub(crate) fn audit_state(home: &Home) -> Value {
    let socket = start::default_operator_socket(home);
    let running = crate::rt::current_thread().ok().and_then(|rt| {
        rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(5), async {
                let mut c = operator_connect(&socket).await.ok()?;
                c.hello("iteron-cli").await.ok()?;
                c.send(OperatorRequest::Status(StatusArg::default()))
                    .await
                    .ok()
            })
            .await
            .ok()
            .flatten()
        })
    });
    if let Some(a) = running.as_ref().and_then(|v| v.get("audit")) {
        return json!({
            "state": a.get("state").cloned().unwrap_or(Value::Null),
            "detail": a.get("detail").cloned().unwrap_or(Value::Null),
            "source": "running broker",
        });
    }
    let i = iteron_broker::audit::inspect(home.dir());
    json!({"state": i.state, "detail": i.detail, "source": "files (no broker answered)"})
}

/// The snapshot to show: a running broker's (what its sessions get, discovered when it
/// started) when one answers on this home's operator socket and `--repo` is absent or names the
/// repository it was started with; otherwise a discovery made now. The second value says which.
fn catalog_view(args: &CatalogArgs) -> Result<(Value, &'static str), CliError> {
    use std::os::unix::ffi::OsStrExt;
    check_repo(args.repo.as_deref())?;
    let home = home()?;
    let socket = start::default_operator_socket(&home);
    if let Some(v) = broker_catalog(&socket) {
        let wanted = args.repo.as_ref().map(|r| {
            let real = std::fs::canonicalize(r).unwrap_or_else(|_| r.clone());
            iteron_broker::audit::sha256_hex(real.as_os_str().as_bytes())
        });
        let broker_repo = v.get("repo_sha256").and_then(Value::as_str);
        if wanted.is_none() || wanted.as_deref() == broker_repo {
            return Ok((v, "broker"));
        }
        let _ = writeln!(
            std::io::stderr(),
            "iteron: note: the running broker was started for another repository; this is a discovery of --repo made now"
        );
    }
    let cat = iteron_broker::catalog::discover(home.dir(), args.repo.as_deref());
    Ok((cat.snapshot_json(), "discovery"))
}

/// A running broker's snapshot, or `None` when no broker of this home answers in time.
fn broker_catalog(socket: &Path) -> Option<Value> {
    let rt = crate::rt::current_thread().ok()?;
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(5), async {
            let mut c = operator_connect(socket).await.ok()?;
            c.hello("iteron-cli").await.ok()?;
            c.send(OperatorRequest::Catalog).await.ok()
        })
        .await
        .ok()
        .flatten()
    })
}

fn rejected_text(out: &mut dyn Write, view: &Value) -> Result<(), CliError> {
    // Path and reason are already terminal-safe; escaping them again would double escapes.
    let empty = Vec::new();
    for r in view
        .get("rejected")
        .and_then(Value::as_array)
        .unwrap_or(&empty)
    {
        let g = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("");
        out_line(out, &format!("rejected {}: {}", g("path"), g("reason")))?;
    }
    let more = view
        .get("rejected_more")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if more > 0 {
        out_line(out, &format!("({more} more rejected)"))?;
    }
    let omitted = view.get("omitted").and_then(Value::as_u64).unwrap_or(0);
    if omitted > 0 {
        out_line(
            out,
            &format!("({omitted} entries over the snapshot's size bound not shown)"),
        )?;
    }
    Ok(())
}

/// One view of the snapshot: its `key` entries (`skills` or `agents`), the rejections of that
/// kind and those concerning both, the counts, and where it came from.
fn view_of(snapshot: &Value, key: &str, source: &str) -> Value {
    let kind = if key == "skills" { "skill" } else { "agent" };
    let rejected: Vec<Value> = snapshot
        .get("rejected")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|r| r["kind"] == kind || r["kind"] == "other")
        .map(|r| json!({"path": r["path"], "reason": r["reason"]}))
        .collect();
    json!({
        key: snapshot.get(key).cloned().unwrap_or_else(|| json!([])),
        "rejected": rejected,
        "rejected_more": snapshot.get("rejected_more").cloned().unwrap_or(json!(0)),
        "omitted": snapshot.get("omitted").cloned().unwrap_or(json!(0)),
        "source": source,
    })
}

/// One view (`skills` or `agents`) of the snapshot: JSON as it is, or one text line per entry
/// (`line`) followed by the rejections.
fn run_view(
    args: CatalogArgs,
    out: &mut dyn Write,
    key: &str,
    line: fn(&Value) -> String,
) -> Result<(), CliError> {
    let (snapshot, source) = catalog_view(&args)?;
    let view = view_of(&snapshot, key, source);
    match args.format {
        Format::Json => json_out(out, &view),
        Format::Text => {
            let empty = Vec::new();
            for entry in view.get(key).and_then(Value::as_array).unwrap_or(&empty) {
                out_line(out, &text::single_line(&line(entry)))?;
            }
            rejected_text(out, &view)
        }
    }
}

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v.get(key).and_then(Value::as_str).unwrap_or("")
}

/// `iteron skills`: the skill index (the running broker's, or discovered now), and what was
/// refused and why.
pub(crate) fn run_skills(args: CatalogArgs, out: &mut dyn Write) -> Result<(), CliError> {
    run_view(args, out, "skills", |s| {
        format!(
            "{}  ({})  {}",
            str_of(s, "name"),
            str_of(s, "tier"),
            str_of(s, "description")
        )
    })
}

/// `iteron agents`: the runtime snapshot of agent definitions, with tiers and identities.
pub(crate) fn run_agents(args: CatalogArgs, out: &mut dyn Write) -> Result<(), CliError> {
    run_view(args, out, "agents", |a| {
        let tools: Vec<&str> = a
            .get("tools")
            .and_then(Value::as_array)
            .map(|t| t.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let budget = |k: &str| a["budget"][k].as_u64().unwrap_or(0);
        format!(
            "{}  ({})  identity {}  tools {}  turns {}  wall {} s",
            str_of(a, "name"),
            str_of(a, "tier"),
            str_of(a, "identity").get(..16).unwrap_or_default(),
            tools.join(","),
            budget("max_turns"),
            budget("max_wall_secs")
        )
    })
}
