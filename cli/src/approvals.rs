//! `iteron approvals …`: the operator's side of the approval queue (list, show, approve, deny,
//! answer, watch), a thin client of the operator socket.

use std::io::Write;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use iteron_agent::parse_object;
use iteron_broker::approvals::MAX_PREVIEW;
use iteron_broker::ipc::client::ClientError;
use iteron_broker::ipc::proto::{Answer, Decide, FormAction, OperatorRequest, PendingArg, Show};
use iteron_policy::text;
use serde_json::{Map, Value, json};

use crate::args::{Approvals, ApprovalsArgs, Format, ShowArgs};
use crate::error::CliError;

use crate::broker::{json_out, operator_connect, operator_request, operator_socket, out_line, via};

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
