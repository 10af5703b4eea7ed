//! OAuth against a hostile authorization server, end to end through the built `iteron` binary.
//! A scripted HTTP server on loopback plays the MCP server (its 401 challenge and protected-
//! resource metadata) and the authorization server (metadata, registration, token, revocation),
//! and says whatever a test scripts: terminal escape sequences, carriage returns, bidi and C1
//! controls in every field that could be printed, tokens of the wrong type, size or lifetime, a
//! refusal of the refresh token. The test plays the browser (or a desktop opener that records
//! what it was given). Every byte the CLI prints is checked, and every refusal is also proven by
//! what the server did (or did not) receive. Nothing here needs Node or Python.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Everything a terminal must never receive raw: clear screen, cursor home, a carriage return
/// that overwrites the line with a forged one, a right-to-left override, a C1 CSI, NEL, an
/// isolate.
const H: &str = "\u{1b}[2J\u{1b}[Hlogged in to bank\r\u{202e}lave\u{9b}31m\u{85}\u{2066}x";

/// A login that has not ended by then is stuck.
const DEADLINE: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The scripted server
// ---------------------------------------------------------------------------------------------

/// One request as the server saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }

    fn form(&self) -> std::collections::HashMap<String, String> {
        url::form_urlencoded::parse(self.body.as_bytes())
            .into_owned()
            .collect()
    }

    fn has_auth(&self) -> bool {
        self.headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
    }
}

/// An answer: status, extra headers, JSON body.
type Reply = (u16, Vec<(String, String)>, String);

fn reply(status: u16, v: Value) -> Reply {
    (
        status,
        vec![("Content-Type".into(), "application/json".into())],
        v.to_string(),
    )
}

/// What a hostile provider says, per route; `None` is the well-behaved default.
#[derive(Clone, Default)]
struct Script {
    /// Merged into the protected-resource metadata.
    prm: Option<Value>,
    /// The `WWW-Authenticate` value of the 401 (default: the metadata URL and `mcp:tools`).
    challenge: Option<String>,
    /// Merged into the authorization-server metadata.
    meta: Option<Value>,
    /// The registration answer.
    register: Option<Reply>,
    /// The token endpoint's answers in turn (the last one repeats).
    token: Vec<Reply>,
    /// The MCP endpoint's answer to a request carrying a token.
    mcp_authorized: Option<Reply>,
}

fn merge(into: &mut Value, patch: &Option<Value>) {
    if let (Some(Value::Object(p)), Some(obj)) = (patch, into.as_object_mut()) {
        for (k, v) in p {
            obj.insert(k.clone(), v.clone());
        }
    }
}

struct Provider {
    base: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Provider {
    fn start(script: Script) -> Provider {
        Provider::start_with(move |_| script)
    }

    /// A provider whose script is built from its own base URL.
    fn start_patched(patch: fn(&str) -> Script) -> Provider {
        Provider::start_with(patch)
    }

    fn start_with(make: impl FnOnce(&str) -> Script) -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let script = make(&base);
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let tokens = Arc::new(AtomicUsize::new(0));
        let (b, log) = (base.clone(), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (b, log, script, tokens) =
                    (b.clone(), log.clone(), script.clone(), tokens.clone());
                std::thread::spawn(move || serve(stream, &b, &log, &script, &tokens));
            }
        });
        Provider { base, seen }
    }

    fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base)
    }

    fn to(&self, path: &str) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.path() == path)
            .cloned()
            .collect()
    }
}

fn route(req: &Seen, base: &str, script: &Script, tokens: &AtomicUsize) -> Reply {
    match (req.method.as_str(), req.path()) {
        ("POST", "/mcp") => {
            if req.has_auth()
                && let Some(r) = &script.mcp_authorized
            {
                return r.clone();
            }
            let challenge = script.challenge.clone().unwrap_or_else(|| {
                format!(
                    "Bearer resource_metadata=\"{base}/.well-known/oauth-protected-resource/mcp\", scope=\"mcp:tools\""
                )
            });
            (
                401,
                vec![("WWW-Authenticate".into(), challenge)],
                String::new(),
            )
        }
        ("GET", "/.well-known/oauth-protected-resource/mcp") => {
            let mut v = json!({"resource": format!("{base}/mcp"), "authorization_servers": [base]});
            merge(&mut v, &script.prm);
            reply(200, v)
        }
        ("GET", "/.well-known/oauth-authorization-server") => {
            let mut v = json!({
                "issuer": base,
                "authorization_endpoint": format!("{base}/authorize"),
                "token_endpoint": format!("{base}/token"),
                "registration_endpoint": format!("{base}/register"),
                "revocation_endpoint": format!("{base}/revoke"),
                "response_types_supported": ["code"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["none"],
            });
            merge(&mut v, &script.meta);
            reply(200, v)
        }
        ("POST", "/register") => script
            .register
            .clone()
            .unwrap_or_else(|| reply(201, json!({"client_id": "dyn-client"}))),
        ("POST", "/token") => {
            let n = tokens.fetch_add(1, Ordering::SeqCst);
            match script
                .token
                .get(n.min(script.token.len().saturating_sub(1)))
            {
                Some(r) => r.clone(),
                None => reply(
                    200,
                    json!({"access_token": format!("at-{n}"), "token_type": "Bearer",
                           "expires_in": 3600, "refresh_token": format!("rt-{n}")}),
                ),
            }
        }
        ("POST", "/revoke") => reply(200, json!({})),
        _ => (404, Vec::new(), String::new()),
    }
}

fn serve(
    mut stream: TcpStream,
    base: &str,
    log: &Mutex<Vec<Seen>>,
    script: &Script,
    tokens: &AtomicUsize,
) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split(' ');
    let method = first.next().unwrap_or("").to_owned();
    let target = first.next().unwrap_or("").to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| {
            l.split_once(':')
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        })
        .collect();
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let req = Seen {
        method,
        target,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    log.lock().unwrap().push(req.clone());
    let (status, extra, body) = route(&req, base, script, tokens);
    let mut out = format!(
        "HTTP/1.1 {status} Scripted\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    out.push_str("\r\n");
    out.push_str(&body);
    let _ = stream.write_all(out.as_bytes());
}

// ---------------------------------------------------------------------------------------------
// The operator's side
// ---------------------------------------------------------------------------------------------

struct Home {
    root: PathBuf,
}

impl Home {
    fn new() -> Home {
        static N: AtomicU64 = AtomicU64::new(0);
        let root = std::env::temp_dir().join(format!(
            "iteron-oauth-hostile-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("bin")).unwrap();
        Home { root }
    }

    fn home(&self) -> PathBuf {
        self.root.join("home")
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_iteron"));
        c.args(args)
            .env_clear()
            .env(
                "PATH",
                format!("{}:/usr/bin:/bin", self.root.join("bin").display()),
            )
            .env("ITERON_HOME", self.home());
        c
    }

    fn run(&self, args: &[&str]) -> Ran {
        let out = self.cmd(args).output().unwrap();
        Ran {
            code: out.status.code(),
            stdout: out.stdout,
            stderr: out.stderr,
        }
    }

    fn add(&self, p: &Provider) {
        let r = self.run(&["mcp", "add", "srv", "--url", &p.mcp_url()]);
        assert_eq!(r.code, Some(0), "{}", r.err());
    }

    fn credential_path(&self) -> Option<PathBuf> {
        std::fs::read_dir(self.home().join("mcp-credentials"))
            .ok()?
            .filter_map(Result::ok)
            .find(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .map(|e| e.path())
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// A finished command.
struct Ran {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl Ran {
    fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    /// Nothing printed holds a control character (other than line feeds between lines), a
    /// bidi control or an isolate.
    fn assert_terminal_safe(&self, what: &str) {
        for bytes in [&self.stdout, &self.stderr] {
            let s = String::from_utf8_lossy(bytes);
            for c in s.chars() {
                let bad = (c.is_control() && c != '\n')
                    || matches!(c, '\u{200e}' | '\u{200f}' | '\u{061c}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
                assert!(
                    !bad,
                    "{what}: U+{:04X} reached the terminal raw: {s:?}",
                    u32::from(c)
                );
            }
        }
    }
}

/// The query parameter `k` of `url`.
fn param(url: &str, k: &str) -> Option<String> {
    url::Url::parse(url)
        .ok()?
        .query_pairs()
        .find(|(key, _)| key == k)
        .map(|(_, v)| v.into_owned())
}

/// GET `path_and_query` on the loopback callback at `port`; the whole answer.
fn get(port: u16, path_and_query: &str) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = write!(
        s,
        "GET {path_and_query} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    );
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// The callback's port and path of an authorization URL.
fn callback_of(url: &str) -> (u16, String) {
    let cb = url::Url::parse(&param(url, "redirect_uri").expect("a redirect_uri")).unwrap();
    (cb.port().unwrap(), cb.path().to_owned())
}

/// Deliver the authorization response for `url`: a code with its state.
fn answer(url: &str) -> String {
    let (port, path) = callback_of(url);
    let state = param(url, "state").expect("a state");
    get(port, &format!("{path}?code=c0de&state={state}"))
}

/// Run `iteron mcp auth login srv` with `extra`, reading the authorization URL it prints (if it
/// gets that far) and handing it to `browser`; the command's whole output.
fn login(home: &Home, extra: &[&str], browser: impl FnOnce(&str)) -> (Ran, Option<String>) {
    let mut args = vec!["mcp", "auth", "login", "srv"];
    args.extend_from_slice(extra);
    let mut child = home
        .cmd(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    std::thread::spawn(move || {
        let start = Instant::now();
        while start.elapsed() < DEADLINE {
            if flag.load(Ordering::SeqCst) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The login hung: end it so the test fails instead of waiting forever.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        );
    });
    let mut err_pipe = child.stderr.take().unwrap();
    let err_thread = std::thread::spawn(move || {
        let mut e = Vec::new();
        let _ = err_pipe.read_to_end(&mut e);
        e
    });
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut printed = Vec::new();
    let mut url = None;
    let mut browser = Some(browser);
    loop {
        let mut line = Vec::new();
        if out.read_until(b'\n', &mut line).unwrap() == 0 {
            break;
        }
        printed.extend_from_slice(&line);
        let text = String::from_utf8_lossy(&line).trim().to_owned();
        if text.starts_with("http://")
            && let Some(open) = browser.take()
        {
            url = Some(text.clone());
            open(&text);
        }
    }
    let status = child.wait().unwrap();
    done.store(true, Ordering::SeqCst);
    let stderr = err_thread.join().unwrap();
    assert_ne!(
        status.code(),
        None,
        "the login hung: {}",
        String::from_utf8_lossy(&printed)
    );
    (
        Ran {
            code: status.code(),
            stdout: printed,
            stderr,
        },
        url,
    )
}

/// One-line error, exit 8.
fn assert_refused(r: &Ran, what: &str, reason: &str) {
    assert_eq!(r.code, Some(8), "{what}: {} {}", r.out(), r.err());
    let err = r.err();
    assert_eq!(err.lines().count(), 1, "{what}: {err}");
    assert!(err.contains(reason), "{what}: {err}");
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

#[test]
fn nothing_a_hostile_authorization_server_sends_reaches_the_terminal_raw() {
    let mut cases = 0;

    // The granted scope of the token response (the red-team report: screen cleared, a forged
    // line added). The response is refused and its tokens revoked; nothing is stored.
    let p = Provider::start(Script {
        token: vec![reply(
            200,
            json!({"access_token": "at-1", "token_type": "Bearer", "expires_in": 3600,
                   "refresh_token": "rt-1", "scope": format!("mcp:tools {H}")}),
        )],
        ..Script::default()
    });
    let home = Home::new();
    home.add(&p);
    let (r, url) = login(&home, &["--no-browser"], |u| {
        answer(u);
    });
    r.assert_terminal_safe("token scope");
    assert!(url.is_some());
    assert_refused(
        &r,
        "token scope",
        "its scope is not a list of RFC 6749 scope tokens; the new tokens were revoked",
    );
    let revoked: Vec<String> = p
        .to("/revoke")
        .iter()
        .map(|s| s.form()["token"].clone())
        .collect();
    assert_eq!(
        revoked,
        vec!["rt-1", "at-1"],
        "revoked, refresh token first"
    );
    assert!(
        home.credential_path().is_none(),
        "an unusable login was stored"
    );
    cases += 1;

    // error and error_description of a token error response.
    let p = Provider::start(Script {
        token: vec![reply(
            400,
            json!({"error": H, "error_description": H, "error_uri": H}),
        )],
        ..Script::default()
    });
    let home = Home::new();
    home.add(&p);
    let (r, _) = login(&home, &["--no-browser"], |u| {
        answer(u);
    });
    r.assert_terminal_safe("token error");
    assert_refused(
        &r,
        "token error",
        "the authorization server answered 400 error",
    );
    cases += 1;

    // The registration answer's client id.
    let p = Provider::start(Script {
        register: Some(reply(201, json!({"client_id": format!("c-{H}")}))),
        ..Script::default()
    });
    let home = Home::new();
    home.add(&p);
    let (r, url) = login(&home, &["--no-browser"], |_| {});
    r.assert_terminal_safe("registration client_id");
    assert!(url.is_none(), "the browser was involved");
    assert_refused(
        &r,
        "registration client_id",
        "the client_id is not printable ASCII",
    );
    cases += 1;

    // Metadata fields: an endpoint, the issuer, the resource, the issuer list.
    type Patch = fn(&str) -> Script;
    let metadata: [(&str, Patch, &str); 4] = [
        (
            "authorization_endpoint",
            |b| Script {
                meta: Some(json!({"authorization_endpoint": format!("{b}/authorize?x={H}")})),
                ..Script::default()
            },
            "refused authorization_endpoint (host 127.0.0.1): endpoint URL contains a control",
        ),
        (
            "issuer",
            |_| Script {
                meta: Some(json!({"issuer": H})),
                ..Script::default()
            },
            "names another issuer",
        ),
        (
            "resource",
            |b| Script {
                prm: Some(json!({"resource": format!("{b}/mcp?{H}")})),
                ..Script::default()
            },
            "names another resource",
        ),
        (
            "authorization_servers",
            |_| Script {
                prm: Some(json!({"authorization_servers": [format!("http://127.0.0.1:9/{H}")]})),
                ..Script::default()
            },
            "refused issuer (host 127.0.0.1): endpoint URL contains a control",
        ),
    ];
    for (what, patch, reason) in metadata {
        let p = Provider::start_patched(patch);
        let home = Home::new();
        home.add(&p);
        let (r, url) = login(&home, &["--no-browser"], |_| {});
        r.assert_terminal_safe(what);
        assert!(url.is_none(), "{what}: the browser was involved");
        assert_refused(&r, what, reason);
        assert!(!r.err().contains("[REDACTED]"), "{what}: {}", r.err());
        cases += 1;
    }

    // WWW-Authenticate parts and listed scopes: only scope tokens are ever asked for, stored or
    // shown; the login itself succeeds.
    // A header cannot carry controls (the HTTP parser refuses them), so the challenge is
    // hostile with what it can carry: quoted quotes and shell syntax in scope names.
    let p = Provider::start_patched(|b| Script {
        challenge: Some(format!(
            r#"Bearer resource_metadata="{b}/.well-known/oauth-protected-resource/mcp", error="x\"<y>", scope="mcp:tools \"evil\" a\\b""#
        )),
        prm: Some(json!({"scopes_supported": [H, "mcp:tools", format!("a{H}")]})),
        mcp_authorized: Some((
            403,
            vec![(
                "WWW-Authenticate".into(),
                r#"Bearer error="insufficient_scope", scope="mcp:tools $(reboot)""#.into(),
            )],
            String::new(),
        )),
        ..Script::default()
    });
    let home = Home::new();
    home.add(&p);
    let (r, url) = login(&home, &["--no-browser"], |u| {
        answer(u);
    });
    r.assert_terminal_safe("challenge and scopes_supported");
    assert_eq!(r.code, Some(0), "{} {}", r.out(), r.err());
    let url = url.unwrap();
    assert_eq!(param(&url, "scope").as_deref(), Some("mcp:tools"), "{url}");
    assert!(
        r.out()
            .contains("logged in to srv: issuer http://127.0.0.1:"),
        "{}",
        r.out()
    );
    assert!(r.out().contains(", scopes mcp:tools\n"), "{}", r.out());
    cases += 1;
    // The server now asks for more scope with a hostile name: no command is suggested with it.
    let t = home.run(&["mcp", "test", "srv"]);
    t.assert_terminal_safe("insufficient_scope challenge");
    assert_eq!(t.code, Some(8), "{}", t.err());
    assert!(
        t.err()
            .contains("log in again explicitly with iteron mcp auth login srv --scopes and the scopes you choose"),
        "{}",
        t.err()
    );
    cases += 1;
    for format in ["text", "json"] {
        let s = home.run(&["mcp", "auth", "status", "srv", "--format", format]);
        s.assert_terminal_safe("status");
        assert_eq!(s.code, Some(0));
    }

    // A credential file written by something else (an older build, a hand edit) holding those
    // strings: status shows them escaped, and JSON keeps their value.
    let path = home.credential_path().unwrap();
    let mut cred: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    cred["binding"]["granted_scopes"] = json!([H]);
    cred["binding"]["client_id"] = json!(H);
    std::fs::write(&path, serde_json::to_vec(&cred).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let text = home.run(&["mcp", "auth", "status", "srv"]);
    text.assert_terminal_safe("status text of a planted credential");
    assert!(text.out().contains("\\u{1b}[2J"), "{}", text.out());
    let js = home.run(&["mcp", "auth", "status", "srv", "--format", "json"]);
    js.assert_terminal_safe("status json of a planted credential");
    let v: Value = serde_json::from_slice(&js.stdout).unwrap();
    assert_eq!(v["client_id"], H, "the JSON value is unchanged");
    assert_eq!(v["granted_scopes"], json!([H]));
    cases += 1;

    iteron_test_support::record!("P12", json!({"cases": cases}),);
}

/// A fake desktop opener that records its arguments and the mode and content of the file it
/// was given.
fn install_opener(home: &Home) -> PathBuf {
    let log = home.root.join("opener.log");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$@\" > '{log}.args'\nstat -c %a \"$1\" > '{log}.mode'\ncat \"$1\" > '{log}.page'\n",
        log = log.display()
    );
    let bin = home.root.join("bin/xdg-open");
    std::fs::write(&bin, script).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    log
}

fn wait_for(path: &Path) -> String {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if let Ok(s) = std::fs::read_to_string(path)
            && !s.is_empty()
        {
            return s;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{} never appeared", path.display());
}

#[test]
fn the_opener_never_sees_the_state_and_a_stray_callback_does_not_end_the_login() {
    let p = Provider::start(Script::default());
    let home = Home::new();
    home.add(&p);
    let log = install_opener(&home);
    let mut strays = Vec::new();
    let (r, url) = login(&home, &[], |u| {
        let state = param(u, "state").unwrap();
        let challenge = param(u, "code_challenge").unwrap();
        // The opener got one argument: a page in the private home, not the URL.
        let args = wait_for(&PathBuf::from(format!("{}.args", log.display())));
        for secret in [&state, &challenge] {
            assert!(!args.contains(secret.as_str()), "the opener's argv: {args}");
        }
        assert!(!args.contains("state=") && !args.contains("code_challenge"));
        assert_eq!(args.lines().count(), 1, "{args}");
        let page_path = PathBuf::from(args.trim());
        assert!(page_path.starts_with(home.home().join("login")), "{args}");
        let mode = wait_for(&PathBuf::from(format!("{}.mode", log.display())));
        let page = wait_for(&PathBuf::from(format!("{}.page", log.display())));
        assert_eq!(mode.trim(), "600");
        assert!(
            page.contains(&u.replace('&', "&amp;")),
            "the page leads to the URL: {page}"
        );
        // Requests that are not this login's answer: answered, ignored, nothing redeemed.
        let (port, path) = callback_of(u);
        strays.push(get(port, &format!("{path}?code=forged&state=forged")));
        strays.push(get(port, &format!("{path}?code=forged")));
        strays.push(get(port, &format!("/elsewhere?code=forged&state={state}")));
        strays.push(get(port, &format!("{path}?state={state}")));
        assert!(p.to("/token").is_empty(), "a stray answer was redeemed");
        assert!(page_path.exists(), "the page is gone while the login runs");
        strays.push(answer(u));
    });
    r.assert_terminal_safe("login through the opener");
    assert_eq!(r.code, Some(0), "{} {}", r.out(), r.err());
    assert!(url.is_some());
    let codes: Vec<&str> = strays
        .iter()
        .map(|s| s.split("\r\n").next().unwrap_or(""))
        .collect();
    assert_eq!(
        codes,
        vec![
            "HTTP/1.1 400 Bad Request",
            "HTTP/1.1 400 Bad Request",
            "HTTP/1.1 404 Not Found",
            "HTTP/1.1 400 Bad Request",
            "HTTP/1.1 200 OK"
        ]
    );
    let tokens = p.to("/token");
    assert_eq!(tokens.len(), 1);
    assert_eq!(tokens[0].form()["code"], "c0de");
    // The page is gone once the login ended.
    let args = std::fs::read_to_string(format!("{}.args", log.display())).unwrap();
    assert!(
        !Path::new(args.trim()).exists(),
        "the page outlived the login"
    );
    iteron_test_support::record!("P12", json!({"strays": 4}),);
}

/// Log in against `p` (a token that expires within the refresh margin), then `mcp test` once:
/// the refresh happens there.
fn login_then_refresh(p: &Provider, home: &Home) -> Ran {
    home.add(p);
    let (r, _) = login(home, &["--no-browser"], |u| {
        answer(u);
    });
    assert_eq!(r.code, Some(0), "{} {}", r.out(), r.err());
    let t = home.run(&["mcp", "test", "srv"]);
    t.assert_terminal_safe("mcp test");
    t
}

fn status_json(home: &Home) -> Value {
    let s = home.run(&["mcp", "auth", "status", "srv", "--format", "json"]);
    assert_eq!(s.code, Some(0), "{}", s.err());
    serde_json::from_slice(&s.stdout).unwrap()
}

fn first_login() -> Reply {
    reply(
        200,
        json!({"access_token": "at-0", "token_type": "Bearer", "expires_in": 1,
               "refresh_token": "rt-0"}),
    )
}

#[test]
fn a_refused_refresh_says_refresh_failed_and_unkeepable_rotations_are_revoked() {
    // invalid_grant: the refresh token is dead, and status says so.
    let p = Provider::start(Script {
        token: vec![
            first_login(),
            reply(
                400,
                json!({"error": "invalid_grant", "error_description": "refresh token revoked"}),
            ),
        ],
        ..Script::default()
    });
    let home = Home::new();
    let t = login_then_refresh(&p, &home);
    assert_refused(
        &t,
        "invalid_grant",
        "re-login required: the authorization server refused the refresh token (invalid_grant)",
    );
    let v = status_json(&home);
    assert_eq!(v["state"], "refresh_failed", "{v}");
    assert_eq!(v["refreshable"], false, "{v}");
    assert!(
        v["reason"]
            .as_str()
            .unwrap()
            .contains("iteron mcp auth login srv"),
        "{v}"
    );
    let text = home.run(&["mcp", "auth", "status", "srv"]);
    assert!(
        text.out().starts_with("srv: refresh_failed"),
        "{}",
        text.out()
    );
    // Nothing more is sent with the dead refresh token.
    let again = home.run(&["mcp", "test", "srv"]);
    assert_refused(&again, "after invalid_grant", "refused the refresh token");
    assert_eq!(
        p.to("/token").len(),
        2,
        "the dead refresh token was presented again"
    );

    // A rotation into a token over the bound: refused, and the new tokens revoked.
    let big = "A".repeat(16 * 1024 + 1);
    let p = Provider::start(Script {
        token: vec![
            first_login(),
            reply(
                200,
                json!({"access_token": big, "token_type": "Bearer", "expires_in": 3600,
                       "refresh_token": "rt-rotated"}),
            ),
        ],
        ..Script::default()
    });
    let home = Home::new();
    let t = login_then_refresh(&p, &home);
    assert_refused(
        &t,
        "oversized access token",
        "its access_token is longer than 16 KiB; the new tokens were revoked at the authorization server",
    );
    let revoked: Vec<String> = p
        .to("/revoke")
        .iter()
        .map(|s| s.form()["token"].clone())
        .collect();
    assert_eq!(revoked, vec!["rt-rotated".to_owned(), big.clone()]);
    assert_eq!(status_json(&home)["state"], "refresh_failed");

    // Tokens each within the bound whose credential would exceed the stored bound (64 KiB once
    // JSON-escaped): not stored, and revoked rather than dropped.
    let quotes = "\"".repeat(16 * 1024);
    let p = Provider::start(Script {
        token: vec![
            first_login(),
            reply(
                200,
                json!({"access_token": quotes, "token_type": "bearer", "expires_in": 3600,
                       "refresh_token": quotes}),
            ),
        ],
        ..Script::default()
    });
    let home = Home::new();
    let t = login_then_refresh(&p, &home);
    assert_refused(
        &t,
        "unstorable rotation",
        "the new tokens were revoked at the authorization server",
    );
    assert_eq!(p.to("/revoke").len(), 2, "both new tokens revoked");
    assert!(p.to("/revoke").iter().all(|s| s.form()["token"] == quotes));

    iteron_test_support::record!("P12", json!({"cases": 3}),);
}
