//! The agent command's grammar (`iteron-agent …`, and `iteron agent …`, which is the same).
//! Values arrive as plain strings; nothing here echoes a refused value.

use clap::{Args, Subcommand, ValueEnum};

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The broker's agent socket (default: $ITERON_AGENT_SOCKET).
    #[arg(long, value_name = "PATH")]
    pub socket: Option<std::path::PathBuf>,
    /// Open a child session bound to this agent definition (read-only, budgeted).
    #[arg(long, value_name = "NAME")]
    pub agent_type: Option<String>,
    #[command(subcommand)]
    pub action: Agent,
}

#[derive(Debug, Subcommand)]
pub enum Agent {
    /// The tools exposed to this agent.
    Tools(FormatArg),
    /// Call one exposed tool (waits for operator approval).
    Call(CallArgs),
    /// The skill index (names and descriptions).
    Skills(FormatArg),
    /// One skill's instructions.
    UseSkill(SkillArg),
    /// Look up an agent definition by its exact name.
    ResolveAgent(ResolveArgs),
    /// One server's resources.
    Resources(ServerFormat),
    /// Read one resource (waits for operator approval).
    ReadResource(ReadResourceArgs),
    /// One server's prompts.
    Prompts(ServerFormat),
    /// Get one prompt (waits for operator approval).
    GetPrompt(GetPromptArgs),
}

#[derive(Debug, Args)]
pub struct ServerFormat {
    /// Server name.
    pub server: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Args)]
pub struct ReadResourceArgs {
    /// Server name.
    pub server: String,
    /// The resource's URI, as listed.
    pub uri: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Args)]
pub struct GetPromptArgs {
    /// Server name.
    pub server: String,
    /// The prompt's name.
    pub name: String,
    /// The arguments, a JSON object of strings.
    #[arg(long, value_name = "OBJECT", default_value = "{}")]
    pub json: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Args)]
pub struct SkillArg {
    /// The skill's name.
    pub name: String,
}

#[derive(Debug, Args)]
pub struct ResolveArgs {
    /// The agent type (exact, case-sensitive name).
    pub agent_type: String,
    /// A model override.
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Args)]
pub struct CallArgs {
    /// Server name.
    pub server: String,
    /// Tool name.
    pub tool: String,
    /// The arguments, a JSON object.
    #[arg(long, value_name = "OBJECT", default_value = "{}")]
    pub json: String,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Format {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Args)]
pub struct FormatArg {
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}
