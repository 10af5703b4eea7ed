//! The broker's start-up order, in one place: what `iteron broker serve` does, in this order,
//! callable by a test.
//!
//! 1. [`harden`]: the process hardens itself while it still has one thread (no ptrace, no core
//!    dumps, umask 077, no loader, proxy or TLS-root variables); the caller does this before
//!    anything else;
//! 2. [`start`]: the options are checked (`--repo`, the sockets and who may use them), the
//!    configuration is read (a rule that can never match is said now), the systemd credentials
//!    directory is read once and denied to every child, skills and agent definitions are
//!    discovered once for the whole run, the hooks are built from the configuration alone, and
//!    what the operator should know about all that is said;
//! 3. [`Started::serve`]: the daemon reads the configuration again (it must still be readable
//!    before anything listens), opens the audit log, binds both sockets, builds the registry,
//!    reports ready and serves until `stop` ([`daemon::serve`]).
//!
//! Between 2 and 3 the caller makes its runtime and installs what ends the run (the CLI: a
//! single-threaded runtime and SIGTERM/SIGINT/SIGHUP handlers), so a broker that could not stop
//! cleanly never listens.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use iteron_policy::config::Config;
use iteron_policy::text;

use crate::daemon::{self, Ready, ServeError, ServeOptions};
use crate::hooks::HookRunner;
use crate::registry::Lookup;
use crate::store::{Home, StoreError};
use crate::sys::Hardened;
use crate::unit_secrets::UnitSecrets;

/// Why the broker did not start (or stopped with an error).
#[derive(Debug)]
pub enum StartError {
    /// The process could not harden itself (step 1).
    Harden(std::io::Error),
    /// The options do not fit together (a usage error: the CLI exits 2).
    Options(&'static str),
    /// The configuration cannot be read (the CLI exits as for any configuration error).
    Config(StoreError),
    /// The systemd credentials directory cannot be used.
    UnitSecrets(String),
    /// Serving failed: a socket, the audit log, or the configuration as the daemon read it.
    Serve(ServeError),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Harden(e) => write!(f, "cannot harden the broker process: {e}"),
            StartError::Options(why) => f.write_str(why),
            StartError::Config(e) => e.fmt(f),
            StartError::UnitSecrets(why) => f.write_str(why),
            StartError::Serve(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for StartError {}

/// How to start the broker: `iteron broker serve`'s options.
pub struct StartOptions {
    /// The repository whose skills and agent definitions are offered (`--repo`); it must be a
    /// directory.
    pub repo: Option<PathBuf>,
    /// The agent socket; `None` is [`default_agent_socket`], which only a broker serving its
    /// own uid alone may use.
    pub agent_socket: Option<PathBuf>,
    /// The operator socket; `None` is [`default_operator_socket`].
    pub operator_socket: Option<PathBuf>,
    /// Uids allowed on the agent socket; empty is the broker's own uid alone.
    pub allow_uids: Vec<u32>,
    /// Whether approvals can be asked (false: every approval is refused at once).
    pub interactive: bool,
    /// How long an approval or form waits for the operator.
    pub approval_deadline: Duration,
    /// How long a connection may sit idle before it is closed.
    pub idle_deadline: Duration,
    /// The environment the broker reads (the systemd credentials directory's variable, and the
    /// values configured servers name that the directory does not supply).
    pub env: Lookup,
}

/// Step 1: harden the process. Call it first of all, while the process has one thread; it
/// fails if there is a second one.
pub fn harden() -> Result<Hardened, StartError> {
    crate::sys::harden_self().map_err(StartError::Harden)
}

/// The agent socket of a home when none is given: inside the private home, so only for a
/// broker that serves its own uid alone.
pub fn default_agent_socket(home: &Home) -> PathBuf {
    home.dir().join("run").join("agent.sock")
}

/// The operator socket of a home when none is given.
pub fn default_operator_socket(home: &Home) -> PathBuf {
    home.dir().join("run").join("operator.sock")
}

/// A broker prepared by [`start`], ready for [`Started::serve`].
pub struct Started {
    home: Home,
    opts: ServeOptions,
    hooks: Arc<HookRunner>,
    unit: Option<UnitSecrets>,
    env: Lookup,
}

/// Step 2: everything before the sockets, in order (see the module documentation). `hardened`
/// is what step 1 did (its removed variables are named); each line the operator should read
/// (an approval rule that can never match, a hook that cannot run, the variables the
/// credentials directory supplies, the environment variables removed) goes to `notice`,
/// already single-line and terminal-safe.
pub fn start(
    home: Home,
    hardened: &Hardened,
    opts: StartOptions,
    notice: &mut dyn FnMut(&str),
) -> Result<Started, StartError> {
    check_repo(opts.repo.as_deref())?;
    let own = nix::unistd::geteuid().as_raw();
    let allow = if opts.allow_uids.is_empty() {
        vec![own]
    } else {
        opts.allow_uids
    };
    let agent_socket = match opts.agent_socket {
        Some(p) => p,
        None if allow.iter().all(|u| *u == own) => default_agent_socket(&home),
        None => {
            return Err(StartError::Options(
                "--socket is required when another uid is allowed: the default lies inside the private ITERON_HOME",
            ));
        }
    };
    if agent_socket.starts_with(home.dir()) && allow.iter().any(|u| *u != own) {
        return Err(StartError::Options(
            "the agent socket of another uid cannot be inside the private ITERON_HOME",
        ));
    }
    let operator_socket = opts
        .operator_socket
        .unwrap_or_else(|| default_operator_socket(&home));
    let config = home.load().map_err(StartError::Config)?;
    // A rule that can never match is said at start, not left to fail silently.
    for line in rule_warnings(&config) {
        notice(&line);
    }
    // Secrets systemd hands the unit (LoadCredential=): read once, checked, and the directory
    // denied to every child from here on.
    let env = opts.env;
    let unit =
        UnitSecrets::from_env(|k| env(k)).map_err(|e| StartError::UnitSecrets(e.to_string()))?;
    if let Some(u) = &unit {
        crate::confine::deny_to_every_child(vec![u.dir().to_path_buf()]);
    }
    // Skills and agent definitions are discovered once, for the broker's whole run; hooks come
    // only from the operator's configuration.
    let catalog = Arc::new(crate::catalog::discover(home.dir(), opts.repo.as_deref()));
    let hooks = Arc::new(hook_runner(&home, &config));
    let serve = ServeOptions {
        catalog,
        agent_socket,
        operator_socket,
        allow_uids: allow,
        interactive: opts.interactive,
        approval_deadline: opts.approval_deadline,
        idle_deadline: opts.idle_deadline,
    };
    // A hook that cannot run has no opinion on every event, silently: say so now.
    for p in hooks.problems() {
        notice(&text::single_line(&format!(
            "iteron broker: warning: the {} hook {} cannot run: {} (it will have no opinion; see iteron mcp doctor)",
            p.event.as_str(),
            p.command,
            p.why
        )));
    }
    if let Some(u) = &unit {
        let names: Vec<&str> = u.names().collect();
        notice(&text::single_line(&format!(
            "iteron broker: credentials directory supplies {} variable(s){}{}{}",
            names.len(),
            if names.is_empty() { "" } else { ": " },
            names.join(", "),
            if u.ignored().is_empty() {
                String::new()
            } else {
                format!("; ignored: {}", u.ignored().join(", "))
            }
        )));
    }
    if !hardened.removed.is_empty() {
        notice(&text::single_line(&format!(
            "iteron broker: ignoring environment variables: {}",
            hardened.removed.join(", ")
        )));
    }
    Ok(Started {
        home,
        opts: serve,
        hooks,
        unit,
        env,
    })
}

impl Started {
    /// Whether approvals can be asked in this run.
    pub fn interactive(&self) -> bool {
        self.opts.interactive
    }

    /// Step 3: serve until `stop` resolves, calling `ready` once both sockets listen; on stop,
    /// in-flight work is answered and cancelled, children are stopped and the sockets removed
    /// ([`daemon::serve`]). A configured server's variables come from the credentials
    /// directory first, then from the environment.
    pub async fn serve(
        self,
        stop: impl Future<Output = ()>,
        ready: impl FnOnce(&Ready),
    ) -> Result<(), StartError> {
        let Started {
            home,
            opts,
            hooks,
            unit,
            env,
        } = self;
        let lookup: Lookup =
            Arc::new(move |k: &str| unit.as_ref().and_then(|u| u.get(k)).or_else(|| env(k)));
        daemon::serve(home, opts, hooks, lookup, stop, ready)
            .await
            .map_err(StartError::Serve)
    }
}

/// `--repo` must name a directory that exists: a mistyped path would otherwise offer nothing
/// and say nothing. The path is not repeated (it is the operator's input).
pub fn check_repo(repo: Option<&Path>) -> Result<(), StartError> {
    match repo {
        Some(p) if !p.is_dir() => Err(StartError::Options(
            "--repo names no directory (it does not exist, is not a directory, or cannot be reached)",
        )),
        _ => Ok(()),
    }
}

/// One line per approval rule of `config` that can never match, as the broker says it at start.
pub fn rule_warnings(config: &Config) -> Vec<String> {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    iteron_policy::rules::check(config, now)
        .into_iter()
        .map(|(id, f)| {
            text::single_line(&format!(
                "iteron broker: approval rule {id} can never match: {f}"
            ))
        })
        .collect()
}

/// The hooks of `config` as the broker runs them (home denied, `hooks_writable`,
/// `hooks_run_as`).
pub fn hook_runner(home: &Home, config: &Config) -> HookRunner {
    HookRunner::new(config.hooks.clone())
        .with_home(home.dir())
        .with_writable(&config.hooks_writable)
        .with_run_as(config.hooks_run_as.unwrap_or_default())
}
