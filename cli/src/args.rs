//! The command-line grammar. Values arrive here as plain strings and are validated by the
//! `iteron-policy` newtypes in `mcp.rs`, so that a refused value is never echoed by the parser
//! (a mistyped `--env NAME=value` may carry a secret).

use clap::{Args, Parser, Subcommand, ValueEnum};

pub(crate) use iteron_agent::args::{AgentArgs, Format, FormatArg};

/// Iteron: a capability broker that lets an agent act through MCP servers, skills and hooks
/// without ever holding a credential.
#[derive(Debug, Parser)]
#[command(name = "iteron", version, disable_help_subcommand = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Top,
}

#[derive(Debug, Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once per process; size is irrelevant"
)]
pub(crate) enum Top {
    /// Manage MCP server configuration in $ITERON_HOME (default ~/.iteron).
    #[command(subcommand)]
    Mcp(Mcp),
    /// Walk the whole story (broker, agent, approval, audit) in a throwaway home; never
    /// touches ~/.iteron.
    Demo,
    /// Run the privileged broker, or look at and control a running one.
    #[command(subcommand)]
    Broker(Broker),
    /// Approve or deny pending tool calls and answer forms (operator socket).
    Approvals(ApprovalsArgs),
    /// The agent's side: talk to a broker through its socket (needs only the socket path).
    Agent(AgentArgs),
    /// The audit log.
    #[command(subcommand)]
    Audit(Audit),
    /// The skills discovered in ~/.iteron/skills and <repo>/.iteron/skills, and what was refused.
    Skills(CatalogArgs),
    /// The agent definitions discovered in ~/.iteron/agents and <repo>/.iteron/agents.
    Agents(CatalogArgs),
    /// Print a shell completion script (e.g. `iteron completions bash > ~/.local/share/bash-completion/completions/iteron`).
    Completions(CompletionsArgs),
    /// Print the man page (roff) of iteron, or of one command (`iteron man mcp add`).
    Man(ManArgs),
}

#[derive(Debug, Args)]
pub(crate) struct CompletionsArgs {
    /// The shell.
    #[arg(value_enum)]
    pub(crate) shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub(crate) struct ManArgs {
    /// The command whose page to print (default: iteron itself).
    #[arg(value_name = "COMMAND", num_args = 0..=4)]
    pub(crate) command: Vec<String>,
}

#[derive(Debug, Args)]
pub(crate) struct CatalogArgs {
    /// The repository whose .iteron directory is read (workspace input, never authority).
    #[arg(long, value_name = "PATH")]
    pub(crate) repo: Option<std::path::PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Broker {
    /// Run the broker in the foreground until SIGTERM, SIGINT or SIGHUP.
    Serve(ServeArgs),
    /// Each server's phase, generation, version and catalog size (starts nothing).
    Status(BrokerStatusArgs),
    /// Cancel the calls in flight on one server.
    Cancel(BrokerServerArgs),
    /// Restart one server: clear its catalog; it reconnects on the next request.
    Restart(BrokerServerArgs),
    /// Stop one server (it stays stopped until restarted).
    Stop(BrokerServerArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// The agent socket (default: $ITERON_HOME/run/agent.sock; required when another uid is
    /// allowed, since $ITERON_HOME is private).
    #[arg(long, value_name = "PATH")]
    pub(crate) socket: Option<std::path::PathBuf>,
    /// A uid allowed on the agent socket (repeatable; default: the broker's own uid).
    #[arg(long = "allow-uid", value_name = "UID")]
    pub(crate) allow_uid: Vec<u32>,
    /// The operator socket (default: $ITERON_HOME/run/operator.sock).
    #[arg(long, value_name = "PATH")]
    pub(crate) operator_socket: Option<std::path::PathBuf>,
    /// Refuse every approval at once (no operator answers; CI).
    #[arg(long)]
    pub(crate) noninteractive: bool,
    /// The repository whose skills and agent definitions are offered (workspace input).
    #[arg(long, value_name = "PATH")]
    pub(crate) repo: Option<std::path::PathBuf>,
    /// Seconds an approval or form waits for the operator (1-3600).
    #[arg(long, value_name = "SECS", default_value_t = 120,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) approval_timeout: u64,
    /// Seconds a connection may sit with nothing in flight before it is closed (1-86400).
    #[arg(long, value_name = "SECS", default_value_t = 600,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub(crate) idle_timeout: u64,
}

#[derive(Debug, Args)]
pub(crate) struct OperatorSocketArg {
    /// The broker's operator socket (default: $ITERON_HOME/run/operator.sock).
    #[arg(long, value_name = "PATH", global = true)]
    pub(crate) operator_socket: Option<std::path::PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct BrokerStatusArgs {
    /// One server (default: all).
    pub(crate) server: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
    #[command(flatten)]
    pub(crate) socket: OperatorSocketArg,
}

#[derive(Debug, Args)]
pub(crate) struct BrokerServerArgs {
    /// Server name.
    pub(crate) server: String,
    #[command(flatten)]
    pub(crate) socket: OperatorSocketArg,
}

#[derive(Debug, Args)]
pub(crate) struct ApprovalsArgs {
    #[command(subcommand)]
    pub(crate) action: Option<Approvals>,
    #[command(flatten)]
    pub(crate) socket: OperatorSocketArg,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Approvals {
    /// List what is waiting (the default).
    List(FormatArg),
    /// Approve waiting calls.
    Approve(IdsArg),
    /// Deny waiting calls.
    Deny(IdsArg),
    /// Answer one waiting form: --json CONTENT to accept, or --decline / --cancel.
    Answer(AnswerArgs),
    /// Show one waiting call whole: its complete arguments, server, tool, session and peer.
    Show(ShowArgs),
    /// Ask about each waiting call and form on the terminal as it arrives, until end of input
    /// (stdin must be a terminal: what was typed before an item was shown is discarded).
    Watch,
    /// The approval rules of $ITERON_HOME/config.json: list them, check that each can match,
    /// or explain which rule would decide a call (never makes one).
    #[command(subcommand)]
    Rules(Rules),
}

#[derive(Debug, Subcommand)]
pub(crate) enum Rules {
    /// Every rule: id, effect, server/tool, constraints, digest.
    List(FormatArg),
    /// Report every rule that can never match (exits 8 when there is one, like doctor); with
    /// --connect, also against each named server's catalog (tool listed, arguments in its
    /// input schema).
    Check(RulesCheckArgs),
    /// Which rule would decide this call and why, without making it.
    Explain(ExplainArgs),
}

#[derive(Debug, Args)]
pub(crate) struct RulesCheckArgs {
    /// Also connect to the servers the rules name and check against their catalogs.
    #[arg(long)]
    pub(crate) connect: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct ExplainArgs {
    /// Server name.
    pub(crate) server: String,
    /// Tool name (or resources/read, prompts/get).
    pub(crate) tool: String,
    /// The call's arguments, a JSON object.
    #[arg(long, value_name = "OBJECT", default_value = "{}")]
    pub(crate) json: String,
    /// The agent's uid (default: this process's uid).
    #[arg(long, value_name = "UID")]
    pub(crate) uid: Option<u32>,
    /// The session's agent-definition identity (a child session), 64 hex digits.
    #[arg(long, value_name = "SHA256")]
    pub(crate) agent_identity: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct ShowArgs {
    /// The waiting call's id.
    pub(crate) id: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct IdsArg {
    /// The waiting calls' ids (from `iteron approvals list`); each is decided on its own.
    #[arg(required = true, num_args = 1..=64)]
    pub(crate) ids: Vec<u64>,
    /// The call's argument digest (one id only): nothing is decided unless it is the waiting
    /// call's; a call parked by a noninteractive broker is approved only with it.
    #[arg(long, value_name = "SHA256")]
    pub(crate) sha256: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct AnswerArgs {
    /// The waiting form's id.
    pub(crate) id: u64,
    /// The form content, a JSON object.
    #[arg(long, value_name = "OBJECT", conflicts_with_all = ["decline", "cancel"])]
    pub(crate) json: Option<String>,
    /// Decline the form.
    #[arg(long, conflicts_with = "cancel")]
    pub(crate) decline: bool,
    /// Dismiss the form.
    #[arg(long)]
    pub(crate) cancel: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Audit {
    /// Check the whole hash chain: any edit, reordering or removal fails.
    Verify(VerifyArgs),
    /// Per approval rule (id and digest): calls approved, refused and not matched, from the
    /// verified log.
    Rules(FormatArg),
}

#[derive(Debug, Args)]
pub(crate) struct VerifyArgs {
    /// A record the log must hold, as the broker prints it at stop (SEQ:SHA256); repeatable.
    #[arg(long, value_name = "SEQ:SHA256")]
    pub(crate) expect: Vec<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once per process; size is irrelevant"
)]
pub(crate) enum Mcp {
    /// Add a server: `--stdio <command> [--env NAME]... -- <args>` or `--url <url>`.
    Add(AddArgs),
    /// List configured servers.
    List(FormatArg),
    /// Show one server.
    Get(NameFormat),
    /// Remove one server.
    Remove(NameArg),
    /// Connect, negotiate and list tools (never calls a tool).
    Test(TestArgs),
    /// Show servers; with --connect, probe each (bounded) for version and tool count.
    Status(StatusArgs),
    /// Check configuration, files, commands, variables and network settings.
    Doctor(DoctorArgs),
    /// Add the servers of another tool's MCP configuration (Claude Code, Codex, Claude Desktop):
    /// values become variable names to provide, never stored or shown.
    Import(ImportArgs),
    /// OAuth login, status and logout for an HTTP server.
    #[command(subcommand)]
    Auth(Auth),
}

/// Whose configuration `mcp import` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ImportFrom {
    /// Claude Code: `.mcp.json` or `~/.claude.json` (`mcpServers`).
    Claude,
    /// Codex: `~/.codex/config.toml` (`[mcp_servers.NAME]`).
    Codex,
    /// Claude Desktop: `claude_desktop_config.json` (`mcpServers`).
    ClaudeDesktop,
}

#[derive(Debug, Args)]
pub(crate) struct ImportArgs {
    /// Which tool's format the file is in.
    #[arg(long, value_enum)]
    pub(crate) from: ImportFrom,
    /// The file to read.
    pub(crate) file: std::path::PathBuf,
    /// Show what would be imported and refused, and change nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Auth {
    /// Log in: discovery, registration, the browser, a loopback callback.
    Login(LoginArgs),
    /// Show the credential's state (never a token).
    Status(NameFormat),
    /// Revoke (best effort) and delete the stored credential.
    Logout(NameArg),
}

#[derive(Debug, Args)]
pub(crate) struct LoginArgs {
    /// Server name.
    pub(crate) name: String,
    /// The protected resource the metadata must name exactly.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_resource: Option<String>,
    /// Scopes to request, comma-separated (as given, together with those already granted).
    #[arg(long, value_name = "SCOPE,SCOPE")]
    pub(crate) scopes: Option<String>,
    /// Client registration: auto, cimd or dcr.
    #[arg(long, value_name = "auto|cimd|dcr")]
    pub(crate) oauth_client_registration: Option<String>,
    /// Pre-registered client id, or a client ID metadata document URL.
    #[arg(long, value_name = "ID-OR-CIMD-URL")]
    pub(crate) client_id: Option<String>,
    /// Environment variable holding the pre-registered client secret (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) client_secret_env: Option<String>,
    /// Authorization server issuer to use.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_issuer: Option<String>,
    /// Never open a browser; print the authorization URL.
    #[arg(long)]
    pub(crate) no_browser: bool,
}

/// Seconds one probe may take (connect, negotiate, list tools).
#[derive(Debug, Args)]
pub(crate) struct ProbeTimeout {
    /// Seconds one server's probe may take: start or connect, negotiate, list (2-300).
    #[arg(long, value_name = "SECS", default_value_t = crate::probe::PROBE_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(2..=300))]
    pub(crate) timeout: u64,
}

#[derive(Debug, Args)]
pub(crate) struct TestArgs {
    /// Server name.
    pub(crate) name: String,
    #[command(flatten)]
    pub(crate) timeout: ProbeTimeout,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

/// How a run of probes over several servers is bounded.
#[derive(Debug, Args)]
pub(crate) struct ProbeBounds {
    #[command(flatten)]
    pub(crate) each: ProbeTimeout,
    /// Seconds the whole run may take; probes still running then are stopped and reported as
    /// failed (1-3600).
    #[arg(long, value_name = "SECS", default_value_t = crate::probe::RUN_DEADLINE.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub(crate) run_timeout: u64,
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Only this server.
    pub(crate) name: Option<String>,
    /// Probe the servers, several at once (starts stdio servers, contacts HTTP servers).
    #[arg(long)]
    pub(crate) connect: bool,
    #[command(flatten)]
    pub(crate) bounds: ProbeBounds,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Also probe every server, several at once.
    #[arg(long)]
    pub(crate) connect: bool,
    #[command(flatten)]
    pub(crate) bounds: ProbeBounds,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct NameArg {
    /// Server name.
    pub(crate) name: String,
}

#[derive(Debug, Args)]
pub(crate) struct NameFormat {
    /// Server name.
    pub(crate) name: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Default, Args)]
#[command(group(clap::ArgGroup::new("transport").required(true).args(["url", "stdio"])))]
pub(crate) struct AddArgs {
    /// Server name: 1-64 ASCII letters, digits, '.', '_', '-'.
    pub(crate) name: String,

    /// Streamable HTTP endpoint: https, or http to a loopback host.
    #[arg(long, value_name = "URL")]
    pub(crate) url: Option<String>,

    /// Program of a stdio server: an absolute path or a bare name found on the broker's PATH.
    #[arg(long, value_name = "COMMAND")]
    pub(crate) stdio: Option<String>,

    /// Forward this environment variable (NAME only; its value is read when the server starts).
    #[arg(long = "env", value_name = "NAME")]
    pub(crate) env: Vec<String>,

    /// Let the confined stdio server read (and execute) beneath this absolute path.
    #[arg(long = "sandbox-readable", value_name = "PATH")]
    pub(crate) sandbox_readable: Vec<String>,

    /// Let the confined stdio server read and write beneath this absolute path.
    #[arg(long = "sandbox-writable", value_name = "PATH")]
    pub(crate) sandbox_writable: Vec<String>,

    /// Under a root broker, run the stdio server as `nobody` (the default), `root`, or UID:GID.
    #[arg(long = "sandbox-run-as", value_name = "nobody|root|UID:GID")]
    pub(crate) sandbox_run_as: Option<String>,

    /// The stdio server's network: `namespace` (its own; with web_egress, out only through the
    /// broker's zone-judged egress path; the default) or `host` (unconfined).
    #[arg(long = "sandbox-network", value_name = "namespace|host")]
    pub(crate) sandbox_network: Option<String>,

    /// Let the stdio server's egress path reach this destination above the public zone: a
    /// host name, *.suffix, an IP address or a CIDR.
    #[arg(long = "sandbox-egress", value_name = "NAME|*.SUFFIX|CIDR")]
    pub(crate) sandbox_egress: Vec<String>,

    /// HTTP header whose value comes from an environment variable: HEADER=ENV_NAME.
    #[arg(long = "header-env", value_name = "HEADER=ENV_NAME")]
    pub(crate) header_env: Vec<String>,

    /// OAuth protected resource to bind.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_resource: Option<String>,

    /// OAuth scopes to request, comma-separated.
    #[arg(long, value_name = "SCOPE,SCOPE")]
    pub(crate) oauth_scopes: Option<String>,

    /// OAuth client registration: auto, cimd or dcr.
    #[arg(long, value_name = "auto|cimd|dcr")]
    pub(crate) oauth_client_registration: Option<String>,

    /// Pre-registered OAuth client id, or a client ID metadata document URL.
    #[arg(long, value_name = "ID-OR-CIMD-URL")]
    pub(crate) oauth_client_id: Option<String>,

    /// Environment variable holding the pre-registered client secret (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_client_secret_env: Option<String>,

    /// Authorization server issuer to pin.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_issuer: Option<String>,

    /// Where login secrets are kept: file (default) or keyring (never falls back to a file).
    #[arg(long, value_name = "file|keyring")]
    pub(crate) oauth_credential_store: Option<String>,

    /// How tokens are obtained: authorization_code (a browser login, the default),
    /// client_credentials, jwt_bearer (a workload identity token) or id_jag (enterprise-managed).
    #[arg(
        long,
        value_name = "authorization_code|client_credentials|jwt_bearer|id_jag"
    )]
    pub(crate) oauth_grant: Option<String>,

    /// How the pre-registered client authenticates at the token endpoint.
    #[arg(
        long,
        value_name = "client_secret_basic|client_secret_post|private_key_jwt"
    )]
    pub(crate) oauth_token_endpoint_auth: Option<String>,

    /// Absolute path of the client's private key (PKCS#8 PEM, a private file) for private_key_jwt.
    #[arg(long, value_name = "PATH")]
    pub(crate) oauth_client_key_file: Option<String>,

    /// Environment variable (or $CREDENTIALS_DIRECTORY credential) holding that key (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_client_key_env: Option<String>,

    /// Absolute path of the workload's identity token (jwt_bearer, id_jag), read at every exchange.
    #[arg(long, value_name = "PATH")]
    pub(crate) oauth_identity_token_file: Option<String>,

    /// Environment variable (or $CREDENTIALS_DIRECTORY credential) holding that token (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_identity_token_env: Option<String>,

    /// Ask for DPoP-bound (sender-constrained) tokens, with a key only the broker holds.
    #[arg(long)]
    pub(crate) oauth_dpop: bool,

    /// The enterprise identity provider's issuer (id_jag).
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_idp_issuer: Option<String>,

    /// Iteron's client id at that identity provider (id_jag).
    #[arg(long, value_name = "ID")]
    pub(crate) oauth_idp_client_id: Option<String>,

    /// Environment variable holding that client's secret (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_idp_client_secret_env: Option<String>,

    /// Environment variable holding an externally managed access token (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_access_token_env: Option<String>,

    /// Environment variable holding that token's expiry, in Unix seconds (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_expires_at_env: Option<String>,

    /// Token endpoint where the externally managed token is refreshed.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_refresh_url: Option<String>,

    /// Environment variable holding its refresh token (NAME only).
    #[arg(long, value_name = "ENV_NAME")]
    pub(crate) oauth_refresh_token_env: Option<String>,

    /// Revocation endpoint used by `auth logout` for the externally managed token.
    #[arg(long, value_name = "URL")]
    pub(crate) oauth_revoke_url: Option<String>,

    /// Arguments passed to the stdio server, after `--`.
    #[arg(last = true, value_name = "ARGS")]
    pub(crate) args: Vec<String>,
}
