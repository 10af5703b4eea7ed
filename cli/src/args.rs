//! The command-line grammar. Values arrive here as plain strings and are validated by the
//! `iteron-policy` newtypes in `mcp.rs`, so that a refused value is never echoed by the parser
//! (a mistyped `--env NAME=value` may carry a secret).

use clap::{Args, Parser, Subcommand, ValueEnum};

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
    /// Walk the configuration flow in a throwaway home; never touches ~/.iteron.
    Demo,
}

#[derive(Debug, Subcommand)]
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
    Test(NameFormat),
    /// Show servers; with --connect, probe each (bounded) for version and tool count.
    Status(StatusArgs),
    /// Check configuration, files, commands, variables and network settings.
    Doctor(DoctorArgs),
    /// OAuth login, status and logout for an HTTP server.
    #[command(subcommand)]
    Auth(Auth),
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
    /// Scopes to request, comma-separated (used as given).
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

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    /// Only this server.
    pub(crate) name: Option<String>,
    /// Probe the servers (starts stdio servers, contacts HTTP servers).
    #[arg(long)]
    pub(crate) connect: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Also probe every server.
    #[arg(long)]
    pub(crate) connect: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub(crate) format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub(crate) enum Format {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Args)]
pub(crate) struct FormatArg {
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

#[derive(Debug, Args)]
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

    /// Arguments passed to the stdio server, after `--`.
    #[arg(last = true, value_name = "ARGS")]
    pub(crate) args: Vec<String>,
}
