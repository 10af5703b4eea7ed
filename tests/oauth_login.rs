//! OAuth end to end against a real authorization server: `oidc-provider` 9.13.3 (npm, in
//! `tests/oauth/`) protecting an MCP server built on the official TypeScript SDK. The built
//! `iteron` binary logs in with `--no-browser` (the test plays the browser with
//! `tests/oauth/user_agent.py`), `mcp test` uses the stored credential, an expired access token
//! is refreshed with rotation (the old refresh token is then dead at the AS), and logout revokes
//! the grant at the AS and deletes the file. No token ever appears in any output.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::time::{Duration, Instant};

#[allow(dead_code)]
#[path = "../broker/tests/support/scripted.rs"]
mod scripted;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn fixture() -> PathBuf {
    let dir = root().join("tests/oauth");
    assert!(
        dir.join("node_modules/oidc-provider").exists(),
        "the OAuth fixture is not installed: run tests/oauth/setup (./scripts/test does)"
    );
    dir
}

/// A child process that is killed when the test ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Read lines until one starts with `prefix` (bounded by a deadline).
fn wait_line(reader: &mut impl BufRead, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut line = String::new();
    while Instant::now() < deadline {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream ended before {prefix:?}"
        );
        if line.starts_with(prefix) {
            return line.trim().to_owned();
        }
    }
    panic!("no {prefix:?} in time");
}

struct Pair {
    _mcp: Proc,
    _as: Proc,
    stdin: ChildStdin,
    /// The MCP server's stdout lines (drained on a thread so it never blocks on a full pipe).
    mcp_lines: std::sync::mpsc::Receiver<String>,
    mcp_url: String,
    /// The resource its metadata names (the endpoint, or the bare origin).
    resource: String,
    issuer: String,
}

impl Pair {
    /// Have the MCP server name `issuer` from now on (its metadata and token validation).
    fn set_issuer(&mut self, issuer: &str) {
        writeln!(self.stdin, "{issuer}").unwrap();
        self.stdin.flush().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .mcp_lines
                .recv_timeout(left)
                .expect("the MCP server did not take the issuer");
            if line.starts_with("AS_ISSUER ") {
                assert_eq!(line.trim(), format!("AS_ISSUER {issuer}"));
                return;
            }
        }
    }
}

fn start_pair(dir: &Path, access_ttl: &str) -> Pair {
    start_pair_with(dir, access_ttl, &[], &[])
}

fn start_pair_with(
    dir: &Path,
    access_ttl: &str,
    mcp_env: &[(&str, &str)],
    as_env: &[(&str, &str)],
) -> Pair {
    start_pair_full(dir, access_ttl, mcp_env, as_env, false)
}

/// Start an authorization server for `resource`; its issuer (`http://127.0.0.1:<port>`).
fn start_as(
    dir: &Path,
    resource: &str,
    access_ttl: &str,
    as_env: &[(&str, &str)],
) -> (Proc, String) {
    let mut auth = Command::new("node")
        .arg("as.mjs")
        .current_dir(dir)
        .env("MCP_RESOURCE", resource)
        .env("ACCESS_TOKEN_FORMAT", "opaque")
        .env("ACCESS_TTL", access_ttl)
        .envs(as_env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut as_out = BufReader::new(auth.stdout.take().unwrap());
    let as_port = wait_line(&mut as_out, "LISTENING ")["LISTENING ".len()..].to_owned();
    // Keep draining stdout so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in as_out.lines() {});
    (Proc(auth), format!("http://127.0.0.1:{as_port}"))
}

/// The pair, its resource the MCP endpoint or (`at_origin`) the bare origin.
fn start_pair_full(
    dir: &Path,
    access_ttl: &str,
    mcp_env: &[(&str, &str)],
    as_env: &[(&str, &str)],
    at_origin: bool,
) -> Pair {
    let mut mcp = Command::new("node")
        .arg("mcp_server.mjs")
        .envs(mcp_env.iter().copied())
        .env("RESOURCE_AT_ORIGIN", if at_origin { "1" } else { "0" })
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut mcp_out = BufReader::new(mcp.stdout.take().unwrap());
    let port = wait_line(&mut mcp_out, "LISTENING ")["LISTENING ".len()..].to_owned();
    let origin = format!("http://127.0.0.1:{port}");
    let mcp_url = format!("{origin}/mcp");
    let resource = if at_origin { origin } else { mcp_url.clone() };
    let (auth, issuer) = start_as(dir, &resource, access_ttl, as_env);
    let (tx, mcp_lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in mcp_out.lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let stdin = mcp.stdin.take().unwrap();
    let mut pair = Pair {
        _mcp: Proc(mcp),
        _as: auth,
        stdin,
        mcp_lines,
        mcp_url,
        resource,
        issuer: issuer.clone(),
    };
    pair.set_issuer(&issuer);
    pair
}

struct Home(PathBuf);

impl Home {
    fn new() -> Home {
        Home::new_tagged("main")
    }

    fn new_tagged(tag: &str) -> Home {
        let p = std::env::temp_dir().join(format!("iteron-oauth-e2e-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Home(p)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_iteron"));
        c.args(args)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("ITERON_HOME", self.0.join("home"));
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    fn credential(&self) -> Option<serde_json::Value> {
        let dir = self.0.join("home/mcp-credentials");
        let entry = std::fs::read_dir(&dir)
            .ok()?
            .filter_map(Result::ok)
            .find(|e| !e.file_name().to_string_lossy().starts_with('.'))?;
        let meta = std::fs::metadata(entry.path()).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        Some(serde_json::from_slice(&std::fs::read(entry.path()).unwrap()).unwrap())
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The AS's introspection of a token (the fixture's resource-server credentials).
fn introspect(issuer: &str, token: &str) -> serde_json::Value {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import base64,json,sys,urllib.parse,urllib.request\n\
             r=urllib.request.Request(sys.argv[1]+'/token/introspection',data=urllib.parse.urlencode({'token':sys.argv[2]}).encode(),\
             headers={'Authorization':'Basic '+base64.b64encode(b'iteron-test-rs:iteron-test-rs-secret').decode()})\n\
             print(json.dumps(json.load(urllib.request.urlopen(r))))",
        )
        .arg(issuer)
        .arg(token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Ask the AS whether a token is active.
fn active(issuer: &str, token: &str) -> bool {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import base64,json,sys,urllib.parse,urllib.request\n\
             r=urllib.request.Request(sys.argv[1]+'/token/introspection',data=urllib.parse.urlencode({'token':sys.argv[2]}).encode(),\
             headers={'Authorization':'Basic '+base64.b64encode(b'iteron-test-rs:iteron-test-rs-secret').decode()})\n\
             print(json.load(urllib.request.urlopen(r))['active'])",
        )
        .arg(issuer)
        .arg(token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim() == "True"
}

/// Run `cmd`, which must succeed (its stderr is the failure's message).
fn succeeds(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn assert_no_token(outputs: &[&Output], tokens: &[&str]) {
    for o in outputs {
        for stream in [&o.stdout, &o.stderr] {
            let text = String::from_utf8_lossy(stream);
            for t in tokens {
                assert!(!text.contains(t), "a token reached an output");
            }
        }
    }
}

#[test]
fn login_test_refresh_rotation_and_logout_against_a_real_authorization_server() {
    let dir = fixture();
    let pair = start_pair(&dir, "2");
    let home = Home::new();
    let add = home.run(&["mcp", "add", "guarded", "--url", &pair.mcp_url]);
    assert!(add.status.success());

    // Before login: the server refuses.
    let before = home.run(&["mcp", "test", "guarded"]);
    assert_eq!(before.status.code(), Some(8));
    let status = home.run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "logged_out");

    // Login: iteron prints the URL; the "browser" follows the AS's login and consent pages and
    // delivers the redirect to iteron's loopback callback.
    let mut login = home
        .cmd(&["mcp", "auth", "login", "guarded", "--no-browser"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(login.stdout.take().unwrap());
    wait_line(&mut out, "Open this URL");
    let url = wait_line(&mut out, &pair.issuer);
    assert!(url.contains("code_challenge_method=S256"), "{url}");
    // The browser stops at iteron's own redirect URI (the AS's pages are on 127.0.0.1 too).
    let redirect_uri = url::Url::parse(&url)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "redirect_uri")
        .map(|(_, v)| v.into_owned())
        .unwrap();
    assert!(redirect_uri.starts_with("http://127.0.0.1:") && redirect_uri.ends_with("/callback"));
    let browser = Command::new("python3")
        .arg(dir.join("user_agent.py"))
        .arg("--deliver")
        .arg(&url)
        .arg(&redirect_uri)
        .output()
        .unwrap();
    assert!(
        browser.status.success(),
        "{}",
        String::from_utf8_lossy(&browser.stderr)
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status_code = login.wait().unwrap();
    assert!(status_code.success(), "login failed: {rest}");
    assert!(rest.contains("logged in to guarded: issuer"), "{rest}");

    let cred = home.credential().expect("a credential file");
    let access1 = cred["secrets"]["access_token"].as_str().unwrap().to_owned();
    let refresh1 = cred["secrets"]["refresh_token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(cred["binding"]["resource"], pair.mcp_url);
    assert_eq!(cred["binding"]["issuer"], pair.issuer);
    assert_eq!(cred["binding"]["zone"], "loopback");
    assert!(active(&pair.issuer, &access1));

    let status = home.run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "logged_in");
    assert_eq!(v["issuer"], pair.issuer);
    assert_eq!(v["zone"], "loopback");
    assert!(
        v["granted_scopes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s == "mcp:tools"),
        "{v}"
    );

    let test = home.run(&["mcp", "test", "guarded", "--format", "json"]);
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stderr)
    );
    let t: serde_json::Value = serde_json::from_slice(&test.stdout).unwrap();
    assert!(
        t["tools"].as_array().unwrap().iter().any(|x| x == "whoami"),
        "{t}"
    );

    // The access token lives 2 s: the next use refreshes, and the refresh token rotates.
    std::thread::sleep(Duration::from_millis(2500));
    let again = home.run(&["mcp", "test", "guarded"]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let cred2 = home.credential().unwrap();
    let refresh2 = cred2["secrets"]["refresh_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let access2 = cred2["secrets"]["access_token"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_ne!(refresh1, refresh2, "the refresh token rotated");
    assert_ne!(access1, access2);
    assert!(
        !active(&pair.issuer, &refresh1),
        "the old refresh token is refused by the AS"
    );

    // Logout: revoked at the AS, the file is gone.
    let logout = home.run(&["mcp", "auth", "logout", "guarded"]);
    assert!(logout.status.success());
    assert!(
        String::from_utf8_lossy(&logout.stdout).contains("revoked at the authorization server")
    );
    assert!(home.credential().is_none());
    assert!(!active(&pair.issuer, &refresh2));
    let after = home.run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&after.stdout).unwrap();
    assert_eq!(v["state"], "logged_out");

    assert_no_token(
        &[
            &add, &before, &status, &test, &again, &logout, &after, &browser,
        ],
        &[&access1, &refresh1, &access2, &refresh2],
    );
    assert!(!rest.contains(&access1) && !rest.contains(&refresh1));
}

/// Play the browser for an authorization URL: follow the AS's pages and deliver the redirect
/// to iteron's loopback callback (named by the URL's `redirect_uri`).
fn deliver(dir: &Path, url: &str) -> Output {
    let redirect_uri = url::Url::parse(url)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "redirect_uri")
        .map(|(_, v)| v.into_owned())
        .unwrap();
    Command::new("python3")
        .arg(dir.join("user_agent.py"))
        .arg("--deliver")
        .arg(url)
        .arg(&redirect_uri)
        .output()
        .unwrap()
}

/// Log in through the CLI with `extra` arguments, playing the browser; returns the CLI's output.
fn login_via_cli(
    home: &Home,
    dir: &Path,
    pair: &Pair,
    extra: &[&str],
    env: &[(&str, &str)],
) -> String {
    let mut args = vec!["mcp", "auth", "login", "guarded", "--no-browser"];
    args.extend_from_slice(extra);
    let mut login = home
        .cmd(&args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(login.stdout.take().unwrap());
    let mut first = String::new();
    out.read_line(&mut first).unwrap();
    if !first.starts_with("Open this URL") {
        let mut err = String::new();
        std::io::Read::read_to_string(&mut login.stderr.take().unwrap(), &mut err).unwrap();
        panic!("login did not start: {first} {err}");
    }
    let url = wait_line(&mut out, &pair.issuer);
    let browser = deliver(dir, &url);
    assert!(
        browser.status.success(),
        "{}",
        String::from_utf8_lossy(&browser.stderr)
    );
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut login.stderr.take().unwrap(), &mut err).unwrap();
    assert!(
        login.wait().unwrap().success(),
        "login failed: {rest} {err}"
    );
    format!("{url}\n{rest}\n{err}")
}

#[test]
fn a_pre_registered_confidential_client_logs_in_and_the_resource_is_the_token_audience() {
    let dir = fixture();
    let secret = "PRESECRETcanary0a1b2c";
    let pair = start_pair_with(
        &dir,
        "60",
        &[],
        &[
            ("PRE_CLIENT_ID", "iteron-pre"),
            ("PRE_CLIENT_SECRET", secret),
            ("PRE_CLIENT_AUTH_METHOD", "client_secret_basic"),
        ],
    );
    let home = Home::new_tagged("pre");
    add_guarded(&home, &pair);
    let printed = login_via_cli(
        &home,
        &dir,
        &pair,
        &[
            "--client-id",
            "iteron-pre",
            "--client-secret-env",
            "PRE_SECRET",
            "--oauth-issuer",
            &pair.issuer,
        ],
        &[("PRE_SECRET", secret)],
    );
    assert!(!printed.contains(secret), "the client secret was printed");
    // Without a pinned issuer the secret is never sent anywhere: the login refuses first.
    let refused = home
        .cmd(&[
            "mcp",
            "auth",
            "login",
            "guarded",
            "--no-browser",
            "--client-id",
            "iteron-pre",
            "--client-secret-env",
            "PRE_SECRET",
        ])
        .env("PRE_SECRET", secret)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(8));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("pinned issuer"));
    let cred = home.credential().unwrap();
    assert_eq!(cred["binding"]["client_id"], "iteron-pre");
    assert_eq!(cred["binding"]["client_kind"], "pre_registered");
    assert_eq!(cred["binding"]["token_auth"], "client_secret_basic");
    let access = cred["secrets"]["access_token"].as_str().unwrap();
    // RFC 8707: the token is for this resource and no other.
    let info = introspect(&pair.issuer, access);
    assert_eq!(info["active"], true);
    let aud = &info["aud"];
    assert!(
        aud == &serde_json::json!(pair.mcp_url)
            || aud
                .as_array()
                .is_some_and(|a| a.contains(&serde_json::json!(pair.mcp_url))),
        "{info}"
    );
    let test = home.run(&["mcp", "test", "guarded"]);
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stderr)
    );
    for stream in [&test.stdout, &test.stderr] {
        assert!(!String::from_utf8_lossy(stream).contains(access));
    }
    // The configuration never holds a token or the secret.
    let config = std::fs::read_to_string(home.0.join("home/config.json")).unwrap();
    assert!(!config.contains(access) && !config.contains(secret));
}

#[test]
fn insufficient_scope_is_its_own_diagnostic_asking_for_an_explicit_relogin() {
    let dir = fixture();
    let pair = start_pair_with(
        &dir,
        "60",
        &[("REQUIRED_SCOPES", "mcp:admin")],
        &[("MCP_SCOPES", "mcp:tools mcp:admin")],
    );
    let home = Home::new_tagged("scope");
    add_guarded(&home, &pair);
    login_via_cli(&home, &dir, &pair, &[], &[]);
    let test = home.run(&["mcp", "test", "guarded"]);
    assert_eq!(test.status.code(), Some(8));
    let err = String::from_utf8_lossy(&test.stderr);
    assert!(err.contains("requires more scope (mcp:admin)"), "{err}");
    assert!(
        err.contains("iteron mcp auth login guarded --scopes mcp:tools,mcp:admin"),
        "{err}"
    );
    // Nothing was replayed with new authority behind the operator's back.
    let cred = home.credential().unwrap();
    assert_eq!(
        cred["binding"]["granted_scopes"],
        serde_json::json!(["mcp:tools"])
    );
}

/// The secrets of `server`'s keyring-backed login in `home`, read from the Secret Service.
fn keyring_secrets(home: &Home, server: &str) -> Option<serde_json::Value> {
    let h = iteron_broker::store::Home::at(home.0.join("home")).unwrap();
    let account = iteron_broker::credentials::CredentialStore::new(&h).keyring_account(server);
    match iteron_broker::keyring::Keyring::system().get(&account) {
        Ok(blob) => {
            Some(serde_json::from_slice::<serde_json::Value>(&blob).unwrap()["secrets"].clone())
        }
        Err(iteron_broker::keyring::KeyringError::NoEntry) => None,
        Err(e) => panic!("keyring: {e:?}"),
    }
}

#[test]
#[ignore = "needs a D-Bus session bus with an unlocked Secret Service; scripts/test provides one (dbus-run-session + gnome-keyring)"]
fn a_keyring_backed_login_refreshes_and_logs_out_with_no_secret_on_disk() {
    let bus = std::env::var("DBUS_SESSION_BUS_ADDRESS").expect("a D-Bus session");
    let bus_env = [("DBUS_SESSION_BUS_ADDRESS", bus.as_str())];
    let dir = fixture();
    let pair = start_pair(&dir, "2");
    let home = Home::new_tagged("keyring");
    let add = home.run(&[
        "mcp",
        "add",
        "guarded",
        "--url",
        &pair.mcp_url,
        "--oauth-credential-store",
        "keyring",
    ]);
    assert!(add.status.success());
    let run = |args: &[&str]| home.cmd(args).envs(bus_env).output().unwrap();

    let login = login_via_cli(&home, &dir, &pair, &[], &bus_env);
    let file = home.credential().expect("a credential file");
    assert!(file.get("secrets").is_none(), "{file}");
    assert_eq!(file["keyring"]["service"], "iteron-mcp-credentials");
    let s1 = keyring_secrets(&home, "guarded").expect("a keyring entry");
    let access1 = s1["access_token"].as_str().unwrap().to_owned();
    let refresh1 = s1["refresh_token"].as_str().unwrap().to_owned();
    assert!(active(&pair.issuer, &access1));

    let test = run(&["mcp", "test", "guarded"]);
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stderr)
    );
    // Expired: the next use refreshes, and the rotated refresh token lands in the keyring.
    std::thread::sleep(Duration::from_millis(2500));
    let again = run(&["mcp", "test", "guarded"]);
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let s2 = keyring_secrets(&home, "guarded").unwrap();
    let refresh2 = s2["refresh_token"].as_str().unwrap().to_owned();
    assert_ne!(refresh1, refresh2);
    assert!(!active(&pair.issuer, &refresh1));
    // The file never changes on a rotation and never holds a token.
    let file2 = home.credential().unwrap();
    assert_eq!(file, file2);

    // Without the bus the same login fails closed: no fallback to the file.
    let no_bus = home.0.join("no-bus");
    std::fs::create_dir_all(&no_bus).unwrap();
    let blind = home
        .cmd(&["mcp", "test", "guarded"])
        .env("XDG_RUNTIME_DIR", &no_bus)
        .env(
            "DBUS_SESSION_BUS_ADDRESS",
            format!("unix:path={}", no_bus.join("bus").display()),
        )
        .output()
        .unwrap();
    assert!(!blind.status.success());
    assert!(
        String::from_utf8_lossy(&blind.stderr).contains("nothing falls back to a file"),
        "{}",
        String::from_utf8_lossy(&blind.stderr)
    );
    let blind_status = home
        .cmd(&["mcp", "auth", "status", "guarded", "--format", "json"])
        .env("XDG_RUNTIME_DIR", &no_bus)
        .env(
            "DBUS_SESSION_BUS_ADDRESS",
            format!("unix:path={}", no_bus.join("bus").display()),
        )
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&blind_status.stdout).unwrap();
    assert_eq!(v["state"], "keyring_unavailable", "{v}");
    let status = run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "logged_in", "{v}");
    assert_eq!(v["store"], "keyring", "{v}");

    let logout = run(&["mcp", "auth", "logout", "guarded"]);
    assert!(
        logout.status.success(),
        "{}",
        String::from_utf8_lossy(&logout.stderr)
    );
    assert!(home.credential().is_none());
    assert!(keyring_secrets(&home, "guarded").is_none());
    assert!(!active(&pair.issuer, &refresh2));
    assert!(!login.contains(&access1) && !login.contains(&refresh1));
    assert_no_token(
        &[&add, &test, &again, &blind, &blind_status, &status, &logout],
        &[&access1, &refresh1, &refresh2],
    );
}

#[test]
fn tokens_that_cannot_be_stored_are_revoked_not_left_live() {
    use std::os::unix::fs::DirBuilderExt;
    let dir = fixture();
    let pair = start_pair(&dir, "60");
    let home = Home::new_tagged("unstorable");
    add_guarded(&home, &pair);
    // A directory where the credential file must go: the login completes at the AS, then
    // storing fails.
    let creds = home.0.join("home/mcp-credentials");
    let mut b = std::fs::DirBuilder::new();
    b.mode(0o700).recursive(true);
    b.create(&creds).unwrap();
    std::fs::set_permissions(home.0.join("home"), std::fs::Permissions::from_mode(0o700)).unwrap();
    b.create(
        creds.join(iteron_broker::credentials::CredentialStore::binding_id(
            "guarded",
        )),
    )
    .unwrap();

    let mut login = home
        .cmd(&["mcp", "auth", "login", "guarded", "--no-browser"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(login.stdout.take().unwrap());
    wait_line(&mut out, "Open this URL");
    let url = wait_line(&mut out, &pair.issuer);
    let browser = deliver(&dir, &url);
    assert!(browser.status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut login.stderr.take().unwrap(), &mut err).unwrap();
    let status = login.wait().unwrap();
    assert_eq!(status.code(), Some(8), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("the new tokens were revoked at the authorization server"),
        "{err}"
    );
}

#[test]
fn a_refresh_token_the_real_authorization_server_refuses_shows_as_refresh_failed() {
    let dir = fixture();
    let pair = start_pair(&dir, "2");
    let home = Home::new_tagged("refused");
    add_guarded(&home, &pair);
    login_via_cli(&home, &dir, &pair, &[], &[]);
    let cred = home.credential().unwrap();
    let refresh = cred["secrets"]["refresh_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let client_id = cred["binding"]["client_id"].as_str().unwrap().to_owned();
    // The grant is revoked behind Iteron's back (as an administrator or the user would).
    let revoked = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys,urllib.parse,urllib.request\n\
             r=urllib.request.Request(sys.argv[1]+'/token/revocation',data=urllib.parse.urlencode({'token':sys.argv[2],'client_id':sys.argv[3]}).encode())\n\
             print(urllib.request.urlopen(r).status)",
        )
        .args([&pair.issuer, &refresh, &client_id])
        .output()
        .unwrap();
    assert!(
        revoked.status.success(),
        "{}",
        String::from_utf8_lossy(&revoked.stderr)
    );
    assert!(!active(&pair.issuer, &refresh));
    // The access token lives 2 s: the next use refreshes, and the AS answers invalid_grant.
    std::thread::sleep(Duration::from_millis(2500));
    let test = home.run(&["mcp", "test", "guarded"]);
    assert_eq!(test.status.code(), Some(8));
    let err = String::from_utf8_lossy(&test.stderr);
    assert!(
        err.contains("the authorization server refused the refresh token (invalid_grant)"),
        "{err}"
    );
    let status = home.run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "refresh_failed", "{v}");
    assert_eq!(v["refreshable"], false, "{v}");
    assert_no_token(&[&test, &status], &[&refresh]);
    // A new login clears it.
    login_via_cli(&home, &dir, &pair, &[], &[]);
    let status = home.run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "logged_in", "{v}");
    iteron_test_support::record!(
        "P12",
        serde_json::json!({"authorization_server": "oidc-provider"}),
    );
}

/// Replace server `name`'s `oauth` block in the home's configuration (the file keeps its mode).
fn set_oauth(home: &Home, name: &str, oauth: serde_json::Value) {
    let path = home.0.join("home/config.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let servers = doc["mcp_servers"].as_array_mut().unwrap();
    let server = servers.iter_mut().find(|s| s["name"] == name).unwrap();
    server["oauth"] = oauth;
    std::fs::write(&path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
}

/// The lines of a shared `REQUEST_LOG`.
fn log_lines(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The prefix of a token's SHA-256 that `mcp_server.mjs` logs.
fn token_sha256(token: &str) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(token.as_bytes());
    d.iter().map(|b| format!("{b:02x}")).collect::<String>()[..16].to_owned()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// Add the server `guarded` at the pair's MCP endpoint to the home.
fn add_guarded(home: &Home, pair: &Pair) {
    assert!(
        home.run(&["mcp", "add", "guarded", "--url", &pair.mcp_url])
            .status
            .success()
    );
}

/// The access and refresh tokens of a stored credential.
fn token_pair(cred: &serde_json::Value) -> (String, String) {
    let secret = |name: &str| cred["secrets"][name].as_str().unwrap().to_owned();
    (secret("access_token"), secret("refresh_token"))
}

/// The `oauth` block of an externally managed token: the access token (and, with `expiry`, its
/// expiry) and the refresh token named by variables, renewed and revoked at the pair's AS as
/// `client_id`.
fn external_oauth(pair: &Pair, client_id: &str, expiry: bool) -> serde_json::Value {
    let mut oauth = serde_json::json!({
        "access_token_env": "CI_ACCESS",
        "refresh_url": format!("{}/token", pair.issuer),
        "refresh_token_env": "CI_REFRESH",
        "revoke_url": format!("{}/token/revocation", pair.issuer),
        "client_id": client_id,
    });
    if expiry {
        oauth["expires_at_env"] = "CI_EXPIRES".into();
    }
    oauth
}

/// The set-up of an externally managed token against the real AS.
struct External {
    /// The `REQUEST_LOG` both servers append to (removed first).
    log: PathBuf,
    pair: Pair,
    /// The home whose login gave the token pair.
    source: Home,
    /// The CI home: the same server, its tokens named by variables, nothing stored.
    ci: Home,
    /// The client the source's login registered (dynamically, a public client).
    client_id: String,
    access: String,
    refresh: String,
}

/// The pair (access tokens living `access_ttl` seconds) logging to `iteron-oauth-<tag>-log-*`;
/// a real token pair from a login in the home `<tag>-source`; the home `<tag>-ci` configured
/// with [`external_oauth`].
fn external(dir: &Path, tag: &str, access_ttl: &str, expiry: bool) -> External {
    let log = std::env::temp_dir().join(format!("iteron-oauth-{tag}-log-{}", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let log_s = log.to_str().unwrap();
    let pair = start_pair_with(
        dir,
        access_ttl,
        &[("REQUEST_LOG", log_s)],
        &[("REQUEST_LOG", log_s)],
    );
    let source = Home::new_tagged(&format!("{tag}-source"));
    add_guarded(&source, &pair);
    login_via_cli(&source, dir, &pair, &[], &[]);
    let cred = source.credential().unwrap();
    let (access, refresh) = token_pair(&cred);
    let client_id = cred["binding"]["client_id"].as_str().unwrap().to_owned();
    let ci = Home::new_tagged(&format!("{tag}-ci"));
    add_guarded(&ci, &pair);
    set_oauth(&ci, "guarded", external_oauth(&pair, &client_id, expiry));
    External {
        log,
        pair,
        source,
        ci,
        client_id,
        access,
        refresh,
    }
}

/// `iteron broker serve` for the home on `<home>/agent.sock` with `env`, once it accepts
/// connections; the socket's path.
fn serve_broker(home: &Home, env: &[(&str, &str)]) -> (Proc, String) {
    let sock = home.0.join("agent.sock");
    let sock_s = sock.to_str().unwrap().to_owned();
    let broker = Proc(
        home.cmd(&["broker", "serve", "--socket", &sock_s])
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    assert!(
        iteron_test_support::wait_listening(&[&sock], Duration::from_secs(15)),
        "the broker did not start"
    );
    (broker, sock_s)
}

/// `iteron agent` through the broker's socket, with nothing of the operator's environment.
fn agent(sock: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iteron"))
        .args(["agent", "--socket", sock])
        .args(args)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .output()
        .unwrap()
}

/// `mcp auth logout guarded` without the variables: the running broker revokes the tokens it
/// holds and says so.
fn logout_through_the_broker(ci: &Home) -> Output {
    let logout = ci.run(&["mcp", "auth", "logout", "guarded"]);
    let said = String::from_utf8_lossy(&logout.stdout).into_owned();
    assert!(
        logout.status.success() && said.contains("the running broker revoked its tokens"),
        "{said} {}",
        String::from_utf8_lossy(&logout.stderr)
    );
    logout
}

/// `broker status`, which must say the server's tokens were revoked by the logout.
fn broker_status_says_revoked(ci: &Home) -> Output {
    let status = ci.run(&["broker", "status", "--format", "json"]);
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(text.contains("revoked by iteron mcp auth logout"), "{text}");
    status
}

#[test]
fn an_externally_managed_token_is_renewed_before_expiry_rotated_in_memory_and_revoked_at_logout() {
    let dir = fixture();
    // Access tokens live 20 s: inside the 30 s margin, so every use renews (rotation is used).
    // A real token pair, from a login in another home (a public, dynamically registered client);
    // the CI home: the same server, its token named by variables, nothing stored.
    let ext = external(&dir, "ext", "20", true);
    let status = ext
        .ci
        .run(&["mcp", "auth", "status", "guarded", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["state"], "external", "{v}");
    // Expired by its variable (the token itself is still good at the AS): never sent, renewed
    // first, and renewed again with the rotated refresh token the broker kept in memory.
    let expired = (unix_now() - 10).to_string();
    let env = [
        ("CI_ACCESS", ext.access.as_str()),
        ("CI_EXPIRES", expired.as_str()),
        ("CI_REFRESH", ext.refresh.as_str()),
    ];
    let test = succeeds(ext.ci.cmd(&["mcp", "test", "guarded"]).envs(env));
    let lines = log_lines(&ext.log);
    let refreshes: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["route"] == "token" && l["grant_type"] == "refresh_token")
        .collect();
    assert!(
        refreshes.len() >= 2 && refreshes.iter().all(|l| l["status"] == 200),
        "a renewal with a rotated refresh token was refused: {refreshes:?}"
    );
    assert!(
        refreshes
            .iter()
            .all(|l| l["client_id"] == ext.client_id.as_str()
                && l["resource"] == ext.pair.mcp_url.as_str()),
        "{refreshes:?}"
    );
    let presented: Vec<&str> = lines
        .iter()
        .filter(|l| l["who"] == "mcp")
        .filter_map(|l| l["token_sha256"].as_str())
        .collect();
    assert!(!presented.is_empty());
    assert!(
        !presented.contains(&token_sha256(&ext.access).as_str()),
        "the expired token was sent"
    );
    // The variable's refresh token was rotated away: the AS refuses it now.
    assert!(!active(&ext.pair.issuer, &ext.refresh));
    // Expired, and nothing to renew it with: nothing is sent at all.
    let plain = Home::new_tagged("ext-plain");
    add_guarded(&plain, &ext.pair);
    set_oauth(
        &plain,
        "guarded",
        serde_json::json!({"access_token_env": "CI_ACCESS", "expires_at_env": "CI_EXPIRES"}),
    );
    let before = log_lines(&ext.log).len();
    let refused = plain
        .cmd(&["mcp", "test", "guarded"])
        .envs(env)
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(8));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("there is no refresh token to renew it; nothing was sent"),
        "{err}"
    );
    assert!(
        log_lines(&ext.log)[before..]
            .iter()
            .all(|l| l["who"] != "mcp" || l["has_authorization"] == false),
        "a request carried the expired token"
    );
    // A malformed expiry is refused before anything is sent.
    let bad = plain
        .cmd(&["mcp", "test", "guarded"])
        .envs(env)
        .env("CI_EXPIRES", "tomorrow")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(8));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("CI_EXPIRES (the access token's expiry)")
    );
    // Logout revokes at revoke_url: a fresh pair, still valid, is dead at the AS afterwards.
    login_via_cli(&ext.source, &dir, &ext.pair, &[], &[]);
    let cred = ext.source.credential().unwrap();
    let (access2, refresh2) = token_pair(&cred);
    assert!(active(&ext.pair.issuer, &refresh2));
    // (The second login registered another client: the AS revokes a client's own tokens only.)
    let client_id2 = cred["binding"]["client_id"].as_str().unwrap();
    set_oauth(
        &ext.ci,
        "guarded",
        external_oauth(&ext.pair, client_id2, false),
    );
    let logout = succeeds(
        ext.ci
            .cmd(&["mcp", "auth", "logout", "guarded"])
            .env("CI_ACCESS", &access2)
            .env("CI_REFRESH", &refresh2),
    );
    assert!(
        String::from_utf8_lossy(&logout.stdout).contains("revoked at revoke_url"),
        "{}",
        String::from_utf8_lossy(&logout.stdout)
    );
    assert!(!active(&ext.pair.issuer, &refresh2) && !active(&ext.pair.issuer, &access2));
    let revocations = log_lines(&ext.log)
        .into_iter()
        .filter(|l| l["route"] == "revocation" && l["status"] == 200)
        .count();
    assert!(
        revocations >= 2,
        "refresh and access tokens were not both revoked"
    );
    assert_no_token(
        &[&status, &test, &refused, &bad, &logout],
        &[&ext.access, &ext.refresh, &access2, &refresh2],
    );
    let config = std::fs::read_to_string(ext.ci.0.join("home/config.json")).unwrap();
    assert!(!config.contains(&ext.access) && !config.contains(&ext.refresh));
    assert!(
        ext.ci.credential().is_none(),
        "a token was written to the home"
    );
    let _ = std::fs::remove_file(&ext.log);
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider", "refreshes": refreshes.len(), "revocations": revocations}),
    );
}

#[test]
fn logout_through_a_running_broker_revokes_the_tokens_it_rotated_and_it_never_sends_them_again() {
    let dir = fixture();
    let ext = external(&dir, "ext-broker", "20", true);
    let expired = (unix_now() - 10).to_string();
    let (broker, sock) = serve_broker(
        &ext.ci,
        &[
            ("CI_ACCESS", ext.access.as_str()),
            ("CI_EXPIRES", expired.as_str()),
            ("CI_REFRESH", ext.refresh.as_str()),
        ],
    );
    // The broker renews (the variable says the token expired) and lists the server's tools.
    let tools = agent(&sock, &["tools", "--format", "json"]);
    let listed = String::from_utf8_lossy(&tools.stdout).into_owned();
    assert!(
        tools.status.success() && listed.contains("whoami"),
        "{listed} {}",
        String::from_utf8_lossy(&tools.stderr)
    );
    assert!(
        !active(&ext.pair.issuer, &ext.refresh),
        "the broker did not rotate"
    );
    // Logout without the variables: only the broker knows the tokens it holds now.
    let logout = logout_through_the_broker(&ext.ci);
    let after = log_lines(&ext.log).len();
    // The server was restarted; reconnecting finds the tokens revoked and sends nothing.
    let again = agent(&sock, &["tools", "--format", "json"]);
    assert!(
        !String::from_utf8_lossy(&again.stdout).contains("whoami"),
        "the revoked bearer was used again"
    );
    assert!(
        log_lines(&ext.log)[after..]
            .iter()
            .all(|l| l["who"] != "mcp" || l["has_authorization"] == false),
        "a request carried a revoked token after logout"
    );
    let status = broker_status_says_revoked(&ext.ci);
    drop(broker);
    assert_no_token(
        &[&tools, &logout, &again, &status],
        &[&ext.access, &ext.refresh],
    );
    let _ = std::fs::remove_file(&ext.log);
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider"}),
    );
}

#[test]
fn a_logout_through_a_broker_that_never_used_the_server_keeps_it_from_sending_the_revoked_token() {
    let dir = fixture();
    // Tokens that stay good for the whole test: nothing expires, nothing is renewed.
    let ext = external(&dir, "ext-unused", "600", false);
    let (broker, sock) = serve_broker(
        &ext.ci,
        &[
            ("CI_ACCESS", ext.access.as_str()),
            ("CI_REFRESH", ext.refresh.as_str()),
        ],
    );
    // The broker has not used the server: it revokes the tokens its variables name.
    let logout = logout_through_the_broker(&ext.ci);
    assert!(!active(&ext.pair.issuer, &ext.access) && !active(&ext.pair.issuer, &ext.refresh));
    // Its first use of the server reads the same variables: the revoked tokens are refused
    // before anything is sent (the access token to the MCP server, the refresh token to the AS).
    let tools = agent(&sock, &["tools", "--format", "json"]);
    assert!(
        !String::from_utf8_lossy(&tools.stdout).contains("whoami"),
        "the revoked bearer was used"
    );
    let lines = log_lines(&ext.log);
    let carried: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["who"] == "mcp" && l["has_authorization"] == true)
        .collect();
    assert!(
        carried.is_empty(),
        "a request carried the revoked token (sha256 {}): {carried:?}",
        token_sha256(&ext.access)
    );
    assert!(
        !lines
            .iter()
            .any(|l| l["route"] == "token" && l["grant_type"] == "refresh_token"),
        "the revoked refresh token was presented"
    );
    let status = broker_status_says_revoked(&ext.ci);
    drop(broker);
    assert_no_token(&[&logout, &tools, &status], &[&ext.access, &ext.refresh]);
    let _ = std::fs::remove_file(&ext.log);
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider", "used_before_logout": false}),
    );
}

/// A 0600 copy of the test-only P-256 key (the repository's copy has whatever mode git gave it).
fn private_key_copy(home: &Home) -> PathBuf {
    let src = root().join("fixtures/keys/p256-test-only.pem");
    let dst = home.0.join("ci-client-key.pem");
    std::fs::write(&dst, std::fs::read(src).unwrap()).unwrap();
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o600)).unwrap();
    dst
}

/// A systemd credentials directory (0700) in the home holding the credential `name` (0400).
fn credentials_directory(home: &Home, name: &str, content: &str) -> PathBuf {
    let creds = home.0.join("credentials");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::set_permissions(&creds, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::write(creds.join(name), content).unwrap();
    std::fs::set_permissions(creds.join(name), std::fs::Permissions::from_mode(0o400)).unwrap();
    creds
}

#[test]
fn the_client_credentials_grant_logs_in_without_a_browser_with_each_client_authentication() {
    let dir = fixture();
    let secret = "CCSECRETcanary7f3e9a";
    for method in [
        "client_secret_basic",
        "client_secret_post",
        "private_key_jwt",
    ] {
        let home = Home::new_tagged(&format!("cc-{method}"));
        let key = private_key_copy(&home);
        let log = home.0.join("requests.log");
        let log_s = log.to_str().unwrap().to_owned();
        let as_env = [
            ("CC_CLIENT_ID", "iteron-ci"),
            ("CC_CLIENT_SECRET", secret),
            ("CC_CLIENT_AUTH_METHOD", method),
            ("CC_CLIENT_KEY_FILE", key.to_str().unwrap()),
            ("REQUEST_LOG", log_s.as_str()),
        ];
        let pair = start_pair_with(&dir, "20", &[("REQUEST_LOG", log_s.as_str())], &as_env);
        add_guarded(&home, &pair);
        let mut oauth = serde_json::json!({
            "grant": "client_credentials",
            "client_id": "iteron-ci",
            "issuer": pair.issuer,
            "token_endpoint_auth": method,
        });
        if method == "private_key_jwt" {
            oauth["client_key_file"] = key.to_str().unwrap().into();
        } else {
            oauth["client_secret_env"] = "CI_SECRET".into();
        }
        set_oauth(&home, "guarded", oauth);
        // The secret comes from the environment, or (client_secret_post) from a systemd
        // credentials directory, read by login, test and logout as the broker reads it.
        let creds = credentials_directory(&home, "CI_SECRET", secret);
        let secret_from = |creds: &Path| -> Vec<(String, String)> {
            if method == "client_secret_post" {
                vec![(
                    "CREDENTIALS_DIRECTORY".into(),
                    creds.to_str().unwrap().to_owned(),
                )]
            } else {
                vec![("CI_SECRET".into(), secret.to_owned())]
            }
        };
        // No --no-browser, no callback: the login just fetches a token.
        let login = home
            .cmd(&["mcp", "auth", "login", "guarded"])
            .envs(secret_from(&creds))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&login.stdout).into_owned();
        assert!(
            login.status.success(),
            "{method}: {said} {}",
            String::from_utf8_lossy(&login.stderr)
        );
        assert!(
            said.contains("without a browser (client_credentials grant"),
            "{said}"
        );
        let cred = home.credential().unwrap();
        assert_eq!(cred["binding"]["token_auth"], method, "{cred}");
        assert_eq!(cred["binding"]["client_id"], "iteron-ci");
        assert!(
            cred["secrets"]["client_secret"].is_null(),
            "a configured client secret was copied into the credential"
        );
        let access = cred["secrets"]["access_token"].as_str().unwrap().to_owned();
        let info = introspect(&pair.issuer, &access);
        assert_eq!(info["active"], true, "{info}");
        assert_eq!(info["client_id"], "iteron-ci", "{info}");
        let want_auth = match method {
            "client_secret_basic" => "basic",
            "client_secret_post" => "client_secret_post",
            _ => "client_assertion",
        };
        let grants: Vec<serde_json::Value> = log_lines(&log)
            .into_iter()
            .filter(|l| l["route"] == "token")
            .collect();
        assert_eq!(grants.len(), 1, "{grants:?}");
        assert_eq!(grants[0]["grant_type"], "client_credentials");
        assert_eq!(grants[0]["client_auth"], want_auth, "{grants:?}");
        assert_eq!(grants[0]["resource"], pair.mcp_url.as_str());
        assert_eq!(grants[0]["status"], 200, "{grants:?}");
        // The token lives 20 s, inside the broker's 30 s renewal margin: the next use runs the
        // grant again by itself, as it does for a token about to expire (no sleep, so a slow
        // runner cannot let it lapse before the checks above).
        let test = home
            .cmd(&["mcp", "test", "guarded"])
            .envs(secret_from(&creds))
            .output()
            .unwrap();
        assert!(
            test.status.success(),
            "{method}: {}",
            String::from_utf8_lossy(&test.stderr)
        );
        let grants = log_lines(&log)
            .into_iter()
            .filter(|l| l["route"] == "token" && l["grant_type"] == "client_credentials")
            .count();
        assert!(
            grants >= 2,
            "{method}: the expired token was not renewed by the grant"
        );
        // Logout revokes the current token.
        let current = home.credential().unwrap()["secrets"]["access_token"]
            .as_str()
            .unwrap()
            .to_owned();
        let logout = home
            .cmd(&["mcp", "auth", "logout", "guarded"])
            .envs(secret_from(&creds))
            .output()
            .unwrap();
        assert!(logout.status.success());
        assert!(
            String::from_utf8_lossy(&logout.stdout).contains("revoked at the authorization server"),
            "{method}: {}",
            String::from_utf8_lossy(&logout.stdout)
        );
        assert!(
            String::from_utf8_lossy(&logout.stdout)
                .starts_with("logged out of guarded (client_credentials grant"),
            "{method}: {}",
            String::from_utf8_lossy(&logout.stdout)
        );
        assert!(!active(&pair.issuer, &current));
        assert!(home.credential().is_none());
        let key_pem = std::fs::read_to_string(&key).unwrap();
        let key_body = key_pem.lines().nth(1).unwrap().to_owned();
        assert_no_token(
            &[&login, &test, &logout],
            &[&access, &current, secret, &key_body],
        );
        let config = std::fs::read_to_string(home.0.join("home/config.json")).unwrap();
        assert!(!config.contains(secret) && !config.contains(&key_body));
    }
    // Without any login, the broker's connection obtains the token itself.
    let home = Home::new_tagged("cc-nologin");
    let pair = start_pair_with(
        &dir,
        "60",
        &[],
        &[("CC_CLIENT_ID", "iteron-ci"), ("CC_CLIENT_SECRET", secret)],
    );
    add_guarded(&home, &pair);
    set_oauth(
        &home,
        "guarded",
        serde_json::json!({"grant": "client_credentials", "client_id": "iteron-ci",
            "issuer": pair.issuer, "client_secret_env": "CI_SECRET"}),
    );
    let test = succeeds(
        home.cmd(&["mcp", "test", "guarded"])
            .env("CI_SECRET", secret),
    );
    assert_no_token(&[&test], &[secret]);
    // A wrong secret is refused by the AS, once, and nothing is stored.
    let other = Home::new_tagged("cc-wrong");
    add_guarded(&other, &pair);
    set_oauth(
        &other,
        "guarded",
        serde_json::json!({"grant": "client_credentials", "client_id": "iteron-ci",
            "issuer": pair.issuer, "client_secret_env": "CI_SECRET"}),
    );
    let wrong = other
        .cmd(&["mcp", "auth", "login", "guarded"])
        .env("CI_SECRET", "not-the-secret")
        .output()
        .unwrap();
    assert_eq!(wrong.status.code(), Some(8));
    assert!(
        String::from_utf8_lossy(&wrong.stderr).contains("invalid_client"),
        "{}",
        String::from_utf8_lossy(&wrong.stderr)
    );
    assert!(other.credential().is_none());
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider",
            "methods": ["client_secret_basic", "client_secret_post", "private_key_jwt"]}),
    );
}

#[test]
fn a_private_key_jwt_client_takes_its_key_from_a_credentials_directory_before_the_environment() {
    let dir = fixture();
    let home = Home::new_tagged("cc-key-env");
    let key = private_key_copy(&home);
    let log = home.0.join("requests.log");
    let log_s = log.to_str().unwrap().to_owned();
    let pair = start_pair_with(
        &dir,
        "20",
        &[("REQUEST_LOG", log_s.as_str())],
        &[
            ("CC_CLIENT_ID", "iteron-ci"),
            ("CC_CLIENT_AUTH_METHOD", "private_key_jwt"),
            ("CC_CLIENT_KEY_FILE", key.to_str().unwrap()),
            ("REQUEST_LOG", log_s.as_str()),
        ],
    );
    add_guarded(&home, &pair);
    set_oauth(
        &home,
        "guarded",
        serde_json::json!({"grant": "client_credentials", "client_id": "iteron-ci",
            "issuer": pair.issuer, "token_endpoint_auth": "private_key_jwt",
            "client_key_env": "CI_KEY"}),
    );
    // The client's key in a systemd credentials directory; the environment holds another
    // (valid) key the authorization server does not know for this client.
    let right = std::fs::read_to_string(&key).unwrap();
    let wrong =
        std::fs::read_to_string(root().join("fixtures/keys/rsa-2048-test-only.pem")).unwrap();
    let creds = credentials_directory(&home, "CI_KEY", &right);
    let grants = || -> Vec<serde_json::Value> {
        log_lines(&log)
            .into_iter()
            .filter(|l| l["route"] == "token" && l["grant_type"] == "client_credentials")
            .collect()
    };
    // The environment's key alone: the assertion it signs is refused, once; nothing is stored.
    let env_only = home
        .cmd(&["mcp", "auth", "login", "guarded"])
        .env("CI_KEY", &wrong)
        .output()
        .unwrap();
    assert_eq!(
        env_only.status.code(),
        Some(8),
        "{}",
        String::from_utf8_lossy(&env_only.stderr)
    );
    assert!(
        String::from_utf8_lossy(&env_only.stderr).contains("invalid_client"),
        "{}",
        String::from_utf8_lossy(&env_only.stderr)
    );
    assert!(home.credential().is_none());
    let refused = grants();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0]["client_auth"], "client_assertion");
    assert_eq!(refused[0]["error"], "invalid_client", "{refused:?}");
    // With the credentials directory, its key wins over the environment's.
    let login = succeeds(
        home.cmd(&["mcp", "auth", "login", "guarded"])
            .env("CI_KEY", &wrong)
            .env("CREDENTIALS_DIRECTORY", &creds),
    );
    let cred = home.credential().unwrap();
    assert_eq!(cred["binding"]["token_auth"], "private_key_jwt", "{cred}");
    let access = cred["secrets"]["access_token"].as_str().unwrap().to_owned();
    assert_eq!(introspect(&pair.issuer, &access)["client_id"], "iteron-ci");
    let accepted = grants();
    assert_eq!(accepted.len(), 2, "{accepted:?}");
    assert_eq!(accepted[1]["client_auth"], "client_assertion");
    assert_eq!(accepted[1]["status"], 200, "{accepted:?}");
    assert_eq!(accepted[1]["resource"], pair.mcp_url.as_str());
    // A connection reads the key the same way: the 20 s token is inside the renewal margin, so
    // it runs the grant again with the key from the directory and reaches the server.
    let test = succeeds(
        home.cmd(&["mcp", "test", "guarded"])
            .env("CI_KEY", &wrong)
            .env("CREDENTIALS_DIRECTORY", &creds),
    );
    let renewed = grants();
    assert!(
        renewed.len() >= 3 && renewed[2..].iter().all(|l| l["status"] == 200),
        "{renewed:?}"
    );
    assert!(
        log_lines(&log)
            .iter()
            .any(|l| l["who"] == "mcp" && l["has_authorization"] == true && l["status"] == 200),
        "the server was not reached with the granted token"
    );
    let body = |pem: &str| pem.lines().nth(1).unwrap().to_owned();
    assert_no_token(
        &[&env_only, &login, &test],
        &[&access, &body(&right), &body(&wrong)],
    );
    let config = std::fs::read_to_string(home.0.join("home/config.json")).unwrap();
    assert!(!config.contains(&body(&right)));
    assert!(cred["secrets"]["client_secret"].is_null());
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider", "client_key": "credentials_directory"}),
    );
}

/// POST a JSON-RPC `tools/list` to the MCP server with `authorization` (and no DPoP proof);
/// returns the HTTP status.
fn raw_mcp_status(url: &str, authorization: &str) -> u16 {
    let out = Command::new("python3")
        .arg("-c")
        .arg(
            "import sys,urllib.request,urllib.error\n\
             r=urllib.request.Request(sys.argv[1],data=b'{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"tools/list\"}',\
             headers={'Authorization':sys.argv[2],'Content-Type':'application/json','Accept':'application/json, text/event-stream'})\n\
             try:\n  print(urllib.request.urlopen(r).status)\nexcept urllib.error.HTTPError as e:\n  print(e.code)",
        )
        .arg(url)
        .arg(authorization)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

#[test]
fn dpop_bound_logins_refresh_and_grants_work_against_a_real_authorization_server_that_wants_nonces()
{
    let dir = fixture();
    let home = Home::new_tagged("dpop");
    let log = home.0.join("requests.log");
    let log_s = log.to_str().unwrap().to_owned();
    let secret = "CCDPOPSECRETcanary55";
    let pair = start_pair_with(
        &dir,
        "20",
        &[("REQUEST_LOG", log_s.as_str())],
        &[
            ("REQUEST_LOG", log_s.as_str()),
            ("DPOP_REQUIRE_NONCE", "1"),
            ("CC_CLIENT_ID", "iteron-ci"),
            ("CC_CLIENT_SECRET", secret),
        ],
    );
    add_guarded(&home, &pair);
    set_oauth(&home, "guarded", serde_json::json!({"dpop": true}));
    // The browser login: the code is exchanged with a proof, once refused for a nonce and then
    // sent with it.
    let printed = login_via_cli(&home, &dir, &pair, &[], &[]);
    let cred = home.credential().unwrap();
    let key = cred["secrets"]["dpop_key"].as_str().unwrap().to_owned();
    let access = cred["secrets"]["access_token"].as_str().unwrap().to_owned();
    let refresh = cred["secrets"]["refresh_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let info = introspect(&pair.issuer, &access);
    assert_eq!(info["token_type"], "DPoP", "{info}");
    assert!(
        info["cnf"]["jkt"].as_str().is_some_and(|j| j.len() == 43),
        "{info}"
    );
    let exchanges: Vec<serde_json::Value> = log_lines(&log)
        .into_iter()
        .filter(|l| l["route"] == "token" && l["grant_type"] == "authorization_code")
        .collect();
    assert_eq!(
        exchanges
            .iter()
            .map(|l| (l["status"].clone(), l["error"].clone()))
            .collect::<Vec<_>>(),
        vec![
            (serde_json::json!(400), serde_json::json!("use_dpop_nonce")),
            (serde_json::json!(200), serde_json::Value::Null),
        ],
        "one refusal for the nonce, then exactly one exchange with it"
    );
    // A stolen token is useless without the key: presented as Bearer, or as DPoP without a
    // proof, the server refuses it.
    assert_eq!(
        raw_mcp_status(&pair.mcp_url, &format!("Bearer {access}")),
        401
    );
    assert_eq!(
        raw_mcp_status(&pair.mcp_url, &format!("DPoP {access}")),
        401
    );
    // The token lives 20 s, inside the 30 s renewal margin: the next use refreshes it, and the
    // refresh is DPoP-bound too, and every request carries a proof.
    let before = log_lines(&log).len();
    let test = home.run(&["mcp", "test", "guarded"]);
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stderr)
    );
    let lines = log_lines(&log)[before..].to_vec();
    let refreshes: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| {
            l["route"] == "token" && l["grant_type"] == "refresh_token" && l["status"] == 200
        })
        .collect();
    assert!(!refreshes.is_empty(), "no DPoP-bound refresh");
    let schemes: Vec<&str> = lines
        .iter()
        .filter(|l| l["who"] == "mcp" && l["has_authorization"] == true)
        .filter_map(|l| l["scheme"].as_str())
        .collect();
    assert!(
        !schemes.is_empty() && schemes.iter().all(|s| *s == "DPoP"),
        "{schemes:?}"
    );
    let now = home.credential().unwrap();
    assert_eq!(
        now["secrets"]["dpop_key"],
        key.as_str(),
        "the refresh changed the key"
    );
    let renewed = now["secrets"]["access_token"].as_str().unwrap().to_owned();
    let info = introspect(&pair.issuer, &renewed);
    assert_eq!(info["token_type"], "DPoP", "{info}");
    // A client-credentials grant asks for a DPoP-bound token just the same.
    let ci = Home::new_tagged("dpop-cc");
    add_guarded(&ci, &pair);
    set_oauth(
        &ci,
        "guarded",
        serde_json::json!({"grant": "client_credentials", "client_id": "iteron-ci",
            "issuer": pair.issuer, "client_secret_env": "CI_SECRET", "dpop": true}),
    );
    let login = succeeds(
        ci.cmd(&["mcp", "auth", "login", "guarded"])
            .env("CI_SECRET", secret),
    );
    let cc = ci.credential().unwrap();
    let cc_access = cc["secrets"]["access_token"].as_str().unwrap().to_owned();
    assert!(cc["secrets"]["dpop_key"].is_string());
    assert_ne!(
        cc["secrets"]["dpop_key"],
        key.as_str(),
        "two logins share a key"
    );
    let info = introspect(&pair.issuer, &cc_access);
    assert_eq!(info["token_type"], "DPoP", "{info}");
    let test_cc = succeeds(ci.cmd(&["mcp", "test", "guarded"]).env("CI_SECRET", secret));
    assert!(!printed.contains(&access) && !printed.contains(&key));
    assert_no_token(
        &[&test, &login, &test_cc],
        &[&access, &refresh, &key, &renewed, &cc_access, secret],
    );
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider", "as_nonce": true,
            "refreshes": refreshes.len()}),
    );
}

#[test]
fn status_and_doctor_show_how_each_server_gets_its_tokens_without_contacting_anything() {
    let home = Home::new_tagged("grant-kinds");
    // Nothing listens on these ports: every command below stays local.
    for (name, url) in [
        ("browser", "http://127.0.0.1:9/mcp"),
        ("ci", "http://127.0.0.1:9/ci"),
        ("workload", "http://127.0.0.1:9/wl"),
        ("env", "http://127.0.0.1:9/env"),
        ("enterprise", "http://127.0.0.1:9/ent"),
    ] {
        assert!(
            home.run(&["mcp", "add", name, "--url", url])
                .status
                .success()
        );
    }
    let key = private_key_copy(&home);
    let token = home.0.join("token.jwt");
    std::fs::write(&token, "aaa.bbb.ccc\n").unwrap();
    set_oauth(&home, "browser", serde_json::json!({"dpop": true}));
    set_oauth(
        &home,
        "ci",
        serde_json::json!({"grant": "client_credentials", "client_id": "ci",
            "issuer": "http://127.0.0.1:9", "client_key_file": key.to_str().unwrap(), "dpop": true}),
    );
    set_oauth(
        &home,
        "workload",
        serde_json::json!({"grant": "jwt_bearer", "issuer": "http://127.0.0.1:9",
            "identity_token_file": token.to_str().unwrap()}),
    );
    set_oauth(
        &home,
        "env",
        serde_json::json!({"access_token_env": "CI_TOKEN"}),
    );
    set_oauth(
        &home,
        "enterprise",
        serde_json::json!({"grant": "id_jag", "issuer": "http://127.0.0.1:9", "client_id": "c",
            "identity_token_file": token.to_str().unwrap(),
            "idp_issuer": "http://127.0.0.1:9/idp", "idp_client_id": "i"}),
    );
    let want = [
        ("browser", "authorization_code", true),
        ("ci", "client_credentials", true),
        ("workload", "jwt_bearer", false),
        ("env", "external", false),
        ("enterprise", "id_jag", false),
    ];
    for (name, grant, dpop) in want {
        let out = home.run(&["mcp", "auth", "status", name, "--format", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["grant"], grant, "{v}");
        assert_eq!(v["dpop"], dpop, "{v}");
        let text = home.run(&["mcp", "auth", "status", name]);
        let line = String::from_utf8_lossy(&text.stdout).into_owned();
        assert!(line.contains(&format!("grant {grant}")), "{line}");
        assert_eq!(line.contains("DPoP-bound"), dpop, "{line}");
    }
    let status = home.run(&["mcp", "status", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    for (name, grant, _) in want {
        let row = v["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap();
        assert_eq!(row["grant"], grant, "{row}");
    }
    // doctor reads the key and the identity token now (nothing is sent) and says what is wrong.
    let doctor = home.run(&["mcp", "doctor", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    let grant_check = |name: &str| {
        v["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "grant")
            .unwrap()
            .clone()
    };
    let ci = grant_check("ci");
    assert_eq!(ci["ok"], true, "{ci}");
    assert_eq!(
        ci["detail"],
        "client_credentials (private_key_jwt; no browser needed), DPoP-bound"
    );
    assert_eq!(grant_check("workload")["ok"], true);
    assert_eq!(
        grant_check("browser")["detail"],
        "authorization_code, DPoP-bound"
    );
    // A key file others can read, and an identity token that is not a JWT, fail their check.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&token, "not a jwt\n").unwrap();
    let doctor = home.run(&["mcp", "doctor", "--format", "json"]);
    assert_eq!(doctor.status.code(), Some(8));
    let v: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    let check = |name: &str| {
        v["servers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .unwrap()["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["check"] == "grant")
            .unwrap()
            .clone()
    };
    let ci = check("ci");
    assert_eq!(ci["ok"], false);
    assert!(
        ci["detail"]
            .as_str()
            .unwrap()
            .contains("readable or writable by group or others"),
        "{ci}"
    );
    let wl = check("workload");
    assert_eq!(wl["ok"], false);
    assert!(
        wl["detail"]
            .as_str()
            .unwrap()
            .contains("is not one compact JWT"),
        "{wl}"
    );
    let key_body = std::fs::read_to_string(&key)
        .unwrap()
        .lines()
        .nth(1)
        .unwrap()
        .to_owned();
    assert!(!String::from_utf8_lossy(&doctor.stdout).contains(&key_body));
}

/// The scope an authorization URL asks for, as a list.
fn url_scopes(printed: &str) -> Vec<String> {
    let url = printed.lines().next().unwrap();
    url::Url::parse(url)
        .unwrap()
        .query_pairs()
        .find(|(k, _)| k == "scope")
        .map(|(_, v)| v.split(' ').map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Issue 14 item 3: an issuer and a resource without a path are kept exactly as the operator
/// wrote them (no `/` added), so a pre-registered client pinned to the issuer oidc-provider
/// names (`http://127.0.0.1:<port>`) logs in, bound to a resource that is the bare origin.
#[test]
fn an_issuer_and_a_resource_without_a_path_are_kept_as_written_and_a_pinned_client_logs_in() {
    let dir = fixture();
    let secret = "PRESECRETexact4d5e6f";
    let pair = start_pair_full(
        &dir,
        "60",
        &[],
        &[
            ("PRE_CLIENT_ID", "iteron-pre"),
            ("PRE_CLIENT_SECRET", secret),
            ("PRE_CLIENT_AUTH_METHOD", "client_secret_basic"),
        ],
        true,
    );
    assert!(
        url::Url::parse(&pair.resource).unwrap().path() == "/" && !pair.resource.ends_with('/')
    );
    assert!(!pair.issuer.ends_with('/'));
    let home = Home::new_tagged("exact");
    let add = home.run(&[
        "mcp",
        "add",
        "guarded",
        "--url",
        &pair.mcp_url,
        "--oauth-resource",
        &pair.resource,
        "--oauth-issuer",
        &pair.issuer,
        "--oauth-client-id",
        "iteron-pre",
        "--oauth-client-secret-env",
        "PRE_SECRET",
    ]);
    assert!(
        add.status.success(),
        "{}",
        String::from_utf8_lossy(&add.stderr)
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(home.0.join("home/config.json")).unwrap()).unwrap();
    let oauth = &config["mcp_servers"][0]["oauth"];
    assert_eq!(oauth["issuer"], pair.issuer.as_str(), "{oauth}");
    assert_eq!(oauth["resource"], pair.resource.as_str(), "{oauth}");
    let printed = login_via_cli(&home, &dir, &pair, &[], &[("PRE_SECRET", secret)]);
    assert!(!printed.contains(secret));
    let cred = home.credential().unwrap();
    assert_eq!(cred["binding"]["issuer"], pair.issuer.as_str());
    assert_eq!(cred["binding"]["resource"], pair.resource.as_str());
    assert_eq!(cred["binding"]["client_id"], "iteron-pre");
    let access = cred["secrets"]["access_token"].as_str().unwrap().to_owned();
    let info = introspect(&pair.issuer, &access);
    assert_eq!(info["active"], true);
    assert!(
        info["aud"] == serde_json::json!(pair.resource)
            || info["aud"]
                .as_array()
                .is_some_and(|a| a.contains(&serde_json::json!(pair.resource))),
        "{info}"
    );
    let test = succeeds(
        home.cmd(&["mcp", "test", "guarded"])
            .env("PRE_SECRET", secret),
    );
    // Read back and written again (an unrelated change), the spelling stays.
    assert!(
        home.run(&["mcp", "add", "other", "--url", &pair.mcp_url])
            .status
            .success()
    );
    let again = std::fs::read_to_string(home.0.join("home/config.json")).unwrap();
    assert!(again.contains(&format!("\"{}\"", pair.issuer)), "{again}");
    assert!(again.contains(&format!("\"{}\"", pair.resource)), "{again}");
    assert_no_token(&[&add, &test], &[&access]);
    iteron_test_support::record!(
        "P12",
        serde_json::json!({"issuer_as_written": true, "resource_as_written": true}),
    );
}

/// Issue 14 item 1: an explicit re-login stays on the authorization server its credential was
/// bound to. When the MCP server's metadata names another one, the re-login is refused with one
/// line naming both — before the new server hears anything, and with the stored login intact —
/// until the operator names the new issuer; that login registers anew there and never presents
/// the old server's client.
#[test]
fn a_relogin_stays_on_its_issuer_until_the_operator_names_the_new_one() {
    let dir = fixture();
    let mut pair = start_pair(&dir, "60");
    let home = Home::new_tagged("moved");
    add_guarded(&home, &pair);
    login_via_cli(&home, &dir, &pair, &[], &[]);
    let first = home.credential().unwrap();
    let old_issuer = pair.issuer.clone();
    let old_client = first["binding"]["client_id"].as_str().unwrap().to_owned();

    // The server moves to another authorization server.
    let log = home.0.join("as2.jsonl");
    let (_as2, new_issuer) = start_as(
        &dir,
        &pair.mcp_url,
        "60",
        &[("REQUEST_LOG", log.to_str().unwrap())],
    );
    pair.set_issuer(&new_issuer);
    let refused = home.run(&["mcp", "auth", "login", "guarded", "--no-browser"]);
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains(&new_issuer) && err.contains(&old_issuer) && err.contains("--oauth-issuer"),
        "{err}"
    );
    assert!(!String::from_utf8_lossy(&refused.stdout).contains("Open this URL"));
    assert_eq!(
        home.credential().unwrap(),
        first,
        "the stored login is untouched"
    );
    let heard = || std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        heard(),
        "",
        "the new authorization server heard from the refused login"
    );

    // Named by the operator: the login moves.
    pair.issuer = new_issuer.clone();
    login_via_cli(&home, &dir, &pair, &["--oauth-issuer", &new_issuer], &[]);
    let second = home.credential().unwrap();
    assert_eq!(second["binding"]["issuer"], new_issuer.as_str());
    assert_ne!(second["binding"]["client_id"], old_client.as_str());
    let lines = log_lines(&log);
    assert!(
        lines.iter().any(|l| l["path"] == "/reg"),
        "registered anew: {lines:?}"
    );
    assert!(
        lines.iter().all(|l| l["client_id"] != old_client.as_str()),
        "the old server's client was presented at the new one"
    );
    let test = home.run(&["mcp", "test", "guarded"]);
    assert!(
        test.status.success(),
        "{}",
        String::from_utf8_lossy(&test.stderr)
    );
    iteron_test_support::record!(
        "P12",
        serde_json::json!({"refused_before_contact": true, "moved_when_named": true}),
    );
}

/// Issue 14 item 2: `auth login --scopes X` on an existing credential asks for X together with
/// what was granted before, so a step-up never drops a scope the login already had.
#[test]
fn a_relogin_with_scopes_asks_for_them_together_with_the_granted_ones() {
    let dir = fixture();
    let pair = start_pair_with(&dir, "60", &[], &[("MCP_SCOPES", "mcp:tools mcp:admin")]);
    let home = Home::new_tagged("union");
    add_guarded(&home, &pair);
    let first = login_via_cli(&home, &dir, &pair, &[], &[]);
    assert_eq!(url_scopes(&first), ["mcp:tools"]);
    assert_eq!(
        home.credential().unwrap()["binding"]["granted_scopes"],
        serde_json::json!(["mcp:tools"])
    );
    let again = login_via_cli(&home, &dir, &pair, &["--scopes", "mcp:admin"], &[]);
    let mut asked = url_scopes(&again);
    asked.sort();
    assert_eq!(asked, ["mcp:admin", "mcp:tools"]);
    let cred = home.credential().unwrap();
    let mut granted: Vec<String> = cred["binding"]["granted_scopes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_owned())
        .collect();
    granted.sort();
    assert_eq!(granted, ["mcp:admin", "mcp:tools"]);
    let info = introspect(
        &pair.issuer,
        cred["secrets"]["access_token"].as_str().unwrap(),
    );
    let mut scope: Vec<&str> = info["scope"].as_str().unwrap().split(' ').collect();
    scope.sort_unstable();
    assert_eq!(scope, ["mcp:admin", "mcp:tools"], "{info}");
    iteron_test_support::record!("P12", serde_json::json!({"requested": asked}),);
}

/// Issue 14 item 7: a revocation the authorization server fails is reported as failed, with its
/// HTTP status — never as "offers no revocation" — and the local credential is deleted anyway.
#[test]
fn logout_says_revocation_failed_with_the_status_the_authorization_server_answered() {
    let dir = fixture();
    let pair = start_pair_with(&dir, "60", &[], &[("REVOCATION_STATUS", "500")]);
    let home = Home::new_tagged("revfail");
    add_guarded(&home, &pair);
    login_via_cli(&home, &dir, &pair, &[], &[]);
    let access = home.credential().unwrap()["secrets"]["access_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let logout = home.run(&["mcp", "auth", "logout", "guarded"]);
    assert!(logout.status.success());
    let said = String::from_utf8_lossy(&logout.stdout);
    assert!(said.contains("revocation failed (HTTP 500)"), "{said}");
    assert!(!said.contains("offers no revocation"), "{said}");
    assert!(
        home.credential().is_none(),
        "the local credential is deleted anyway"
    );
    // It really was not revoked: the report is the truth.
    assert!(active(&pair.issuer, &access));
    assert_no_token(&[&logout], &[&access]);
    iteron_test_support::record!("P12", serde_json::json!({"status": 500}),);
}

#[test]
fn a_ci_broker_gets_dpop_bound_client_credentials_tokens_itself_and_an_agent_of_another_uid_never_sees_them()
 {
    // The locked-down CI shape: no browser and no login step. The operator adds the server
    // with flags; the broker (root here) runs the client-credentials grant itself with a
    // DPoP key only it holds, against oidc-provider asking for nonces; an agent running as
    // another uid lists and calls the tool under an approval rule and sees no credential.
    if !iteron_test_support::is_root() {
        eprintln!("skipped: running the agent as uid 65534 needs root (CI runs as root)");
        return;
    }
    use std::os::unix::process::CommandExt;
    let agent_uid = iteron_test_support::CHILD_UID;
    let dir = fixture();
    let ci = Home::new_tagged("ci-other-uid");
    let log = ci.0.join("requests.log");
    let log_s = log.to_str().unwrap().to_owned();
    let secret = "CCUIDSECRETcanary77";
    let pair = start_pair_with(
        &dir,
        "20",
        &[("REQUEST_LOG", log_s.as_str())],
        &[
            ("REQUEST_LOG", log_s.as_str()),
            ("DPOP_REQUIRE_NONCE", "1"),
            ("CC_CLIENT_ID", "iteron-ci"),
            ("CC_CLIENT_SECRET", secret),
        ],
    );
    let add = ci.run(&[
        "mcp",
        "add",
        "guarded",
        "--url",
        &pair.mcp_url,
        "--oauth-grant",
        "client_credentials",
        "--oauth-issuer",
        &pair.issuer,
        "--oauth-client-id",
        "iteron-ci",
        "--oauth-client-secret-env",
        "CI_SECRET",
        "--oauth-dpop",
    ]);
    assert!(
        add.status.success(),
        "{}",
        String::from_utf8_lossy(&add.stderr)
    );
    let config = ci.0.join("home/config.json");
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
    doc["approvals"] = serde_json::json!({"rules": [
        {"id": "ci-whoami", "effect": "allow", "server": "guarded", "tool": "whoami",
         "agent_uids": [agent_uid]}]});
    iteron_test_support::write_private_json(&config, &doc);
    // The socket's directory is reachable by the agent's uid; the home is not.
    let run = ci.0.join("run");
    std::fs::create_dir_all(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o755)).unwrap();
    let sock = run.join("agent.sock");
    let sock_s = sock.to_str().unwrap().to_owned();
    let broker = Proc(
        ci.cmd(&[
            "broker",
            "serve",
            "--noninteractive",
            "--socket",
            &sock_s,
            "--allow-uid",
            &agent_uid.to_string(),
        ])
        .env("CI_SECRET", secret)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    assert!(
        iteron_test_support::wait_listening(&[&sock], Duration::from_secs(20)),
        "the broker did not start"
    );
    let agent = |args: &[&str]| {
        let mut full = vec!["agent", "--socket", sock_s.as_str()];
        full.extend_from_slice(args);
        Command::new(env!("CARGO_BIN_EXE_iteron"))
            .args(&full)
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .current_dir("/")
            .uid(agent_uid)
            .gid(agent_uid)
            .output()
            .unwrap()
    };
    let tools = agent(&["tools", "--format", "json"]);
    let listed = String::from_utf8_lossy(&tools.stdout).into_owned();
    assert!(
        tools.status.success() && listed.contains("whoami"),
        "{listed} {}",
        String::from_utf8_lossy(&tools.stderr)
    );
    let call = agent(&[
        "call", "guarded", "whoami", "--json", "{}", "--format", "json",
    ]);
    let answer = String::from_utf8_lossy(&call.stdout).into_owned();
    assert!(
        call.status.success() && answer.contains("iteron-ci"),
        "{answer} {}",
        String::from_utf8_lossy(&call.stderr)
    );
    // The token came from the grant, through a nonce challenge, and every MCP request the
    // broker made with it was DPoP-bound.
    let lines = log_lines(&log);
    let grants: Vec<(serde_json::Value, serde_json::Value)> = lines
        .iter()
        .filter(|l| l["route"] == "token" && l["grant_type"] == "client_credentials")
        .map(|l| (l["status"].clone(), l["error"].clone()))
        .collect();
    assert_eq!(
        grants.first(),
        Some(&(serde_json::json!(400), serde_json::json!("use_dpop_nonce"))),
        "{grants:?}"
    );
    assert!(
        grants.iter().any(|g| g.0 == 200),
        "the grant never succeeded: {grants:?}"
    );
    let authorized: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["who"] == "mcp" && l["has_authorization"] == true)
        .collect();
    assert!(!authorized.is_empty());
    assert!(
        authorized.iter().all(|l| l["scheme"] == "DPoP"),
        "{authorized:?}"
    );
    // Nothing of the credential reaches the agent, and its uid cannot read the home.
    let peek = Command::new("/bin/cat")
        .arg(&config)
        .uid(agent_uid)
        .gid(agent_uid)
        .output()
        .unwrap();
    assert!(
        !peek.status.success(),
        "the agent's uid read the configuration"
    );
    let records = iteron_test_support::audit_records(&ci.0.join("home"));
    assert!(
        records.iter().any(|r| r["kind"] == "call_tool"
            && r["decision"] == "approved_by_rule"
            && r["peer_uid"] == agent_uid
            && r["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with("rule ci-whoami "))),
        "no audit record names the agent's uid and the rule"
    );
    drop(broker);
    assert_no_token(&[&tools, &call], &[secret, "eyJ"]);
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"authorization_server": "oidc-provider", "agent_uid": agent_uid,
            "grant": "client_credentials", "dpop": true}),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_login_runs_the_jwt_bearer_grant_from_the_command_line_with_a_token_it_rereads() {
    // oidc-provider has no JWT-bearer grant: a scripted authorization server stands in, and
    // the built `iteron` binary does the rest (no browser, no callback).
    use scripted::{Reply, Seen, Server};
    const JWT_BEARER: &str = "urn:ietf:params:oauth:grant-type:jwt-bearer";
    let s = Server::start(|base: &str| {
        let prm = serde_json::json!({"resource": format!("{base}/mcp"),
            "authorization_servers": [base]});
        let meta = serde_json::json!({"issuer": base, "token_endpoint": format!("{base}/token"),
            "grant_types_supported": [JWT_BEARER]});
        std::sync::Arc::new(move |req: &Seen| match (req.method.as_str(), req.path()) {
            ("GET", "/.well-known/oauth-protected-resource/mcp") => Reply::json(prm.clone()),
            ("GET", "/.well-known/oauth-authorization-server") => Reply::json(meta.clone()),
            ("POST", "/token") if req.form()["assertion"].starts_with("refused") => {
                Reply::status(400, serde_json::json!({"error": "invalid_grant"}))
            }
            ("POST", "/token") => Reply::json(serde_json::json!({
                "access_token": "wl-access-cli", "token_type": "Bearer", "expires_in": 600})),
            _ => Reply::not_found(),
        })
    })
    .await;
    let base = s.base();
    let outcome = tokio::task::spawn_blocking(move || {
        let home = Home::new_tagged("wif-cli");
        let token = home.0.join("token.jwt");
        std::fs::write(&token, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJjaS0xIn0.c2lnMQ\n").unwrap();
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
        let add = home.run(&[
            "mcp",
            "add",
            "wif",
            "--url",
            &format!("{base}/mcp"),
            "--oauth-grant",
            "jwt_bearer",
            "--oauth-issuer",
            &base,
            "--oauth-identity-token-file",
            token.to_str().unwrap(),
        ]);
        assert!(
            add.status.success(),
            "{}",
            String::from_utf8_lossy(&add.stderr)
        );
        let login = home.run(&["mcp", "auth", "login", "wif"]);
        let said = String::from_utf8_lossy(&login.stdout).into_owned();
        assert!(
            login.status.success() && said.contains("jwt_bearer"),
            "{said} {}",
            String::from_utf8_lossy(&login.stderr)
        );
        let cred = home.credential().unwrap();
        assert_eq!(cred["secrets"]["access_token"], "wl-access-cli");
        let status = home.run(&["mcp", "auth", "status", "wif", "--format", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
        assert_eq!(v["grant"], "jwt_bearer", "{v}");
        // The runtime rotates the token file: the next login presents the new token; a token
        // the authorization server refuses is reported, with nothing stored in its place.
        std::fs::write(&token, "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJjaS0yIn0.c2lnMg\n").unwrap();
        let again = home.run(&["mcp", "auth", "login", "wif"]);
        assert!(
            again.status.success(),
            "{}",
            String::from_utf8_lossy(&again.stderr)
        );
        std::fs::write(&token, "refused.eyJzdWIiOiJjaS0zIn0.c2lnMw\n").unwrap();
        let refused = home.run(&["mcp", "auth", "login", "wif"]);
        let err = String::from_utf8_lossy(&refused.stderr).into_owned();
        assert!(!refused.status.success(), "{err}");
        assert!(err.contains("invalid_grant"), "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert_no_token(
            &[&login, &again, &refused],
            &["wl-access-cli", "eyJzdWIiOiJjaS0"],
        );
    })
    .await;
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
    let assertions: Vec<String> = s
        .to("/token")
        .iter()
        .map(|r| r.form()["assertion"].clone())
        .collect();
    assert_eq!(
        assertions,
        vec![
            "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJjaS0xIn0.c2lnMQ".to_owned(),
            "eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJjaS0yIn0.c2lnMg".to_owned(),
            "refused.eyJzdWIiOiJjaS0zIn0.c2lnMw".to_owned(),
        ]
    );
    iteron_test_support::record!(
        "P16",
        serde_json::json!({"grant": "jwt_bearer", "via": "iteron mcp auth login"}),
    );
}
