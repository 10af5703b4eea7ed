//! Command-line errors as one line that never quotes what was typed.

use clap::error::{ContextKind, ContextValue, ErrorKind};

fn context(e: &clap::Error, kind: ContextKind) -> Vec<String> {
    match e.get(kind) {
        Some(ContextValue::String(s)) => vec![s.clone()],
        Some(ContextValue::Strings(v)) => v.clone(),
        _ => Vec::new(),
    }
}

/// Our argument's name (`--format <FORMAT>`, `<NAME>`): safe to show, it comes from our grammar.
fn our_arg(e: &clap::Error) -> String {
    context(e, ContextKind::InvalidArg).join(", ")
}

/// What is wrong with a command line, from the error's kind and the *names* of our own
/// arguments — never from the text that was typed (clap's own rendering quotes refused values,
/// and a refused value is often a pasted secret).
pub fn describe_parse_error(e: &clap::Error) -> String {
    match e.kind() {
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => {
            let valid = context(e, ContextKind::ValidValue);
            if valid.is_empty() {
                format!("invalid value for {}", our_arg(e))
            } else {
                format!(
                    "invalid value for {} (expected one of: {})",
                    our_arg(e),
                    valid.join(", ")
                )
            }
        }
        ErrorKind::UnknownArgument => {
            // The unknown word is the operator's text. A flag's name (before any '=') is shown;
            // a bare word is not, since it may be a value pasted where a name belongs.
            let typed = context(e, ContextKind::InvalidArg).concat();
            if typed.starts_with('-') {
                let name = typed.split('=').next().unwrap_or_default();
                let safe = name.len() <= 40
                    && name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
                if safe {
                    return format!("unknown flag {name}");
                }
                return "unknown flag".into();
            }
            "unexpected extra argument (not shown; stdio server arguments go after --)".into()
        }
        ErrorKind::InvalidSubcommand => "unknown command (not shown)".into(),
        ErrorKind::MissingRequiredArgument => {
            format!("missing required argument: {}", our_arg(e))
        }
        ErrorKind::ArgumentConflict => {
            let prior = context(e, ContextKind::PriorArg).join(", ");
            format!("{} cannot be used with {prior}", our_arg(e))
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            "missing command".into()
        }
        ErrorKind::NoEquals => format!("{} needs a value", our_arg(e)),
        ErrorKind::TooManyValues | ErrorKind::TooFewValues | ErrorKind::WrongNumberOfValues => {
            format!("wrong number of values for {}", our_arg(e))
        }
        ErrorKind::InvalidUtf8 => "an argument is not valid UTF-8".into(),
        _ => "invalid command line".into(),
    }
}
