//! `iteron audit …`, `iteron skills` and `iteron agents`: the audit log verified, and the
//! catalog as the running broker (or a discovery now) sees it.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use iteron_broker::ipc::proto::{OperatorRequest, StatusArg};
use iteron_broker::start::{self};
use iteron_broker::store::Home;
use iteron_policy::text;
use serde_json::{Value, json};

use crate::args::{Audit, CatalogArgs, Format};
use crate::error::CliError;

use crate::broker::{check_repo, home, json_out, operator_connect, out_line};

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
