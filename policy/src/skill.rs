//! `SKILL.md`: `name` and `description` frontmatter plus an instruction body. Parsing and
//! bounds only; discovery (which files, which tier, symlinks, vendor paths) is the broker's.
//!
//! Bounds (DESIGN §11): name 64 bytes, description 1 KiB, body 256 KiB, 256 index entries.
//! The whole file — frontmatter and body — is refused if it holds any bidirectional control or
//! invisible (default-ignorable) character, or any other character [`text::check_untrusted`]
//! refuses (line feeds and tabs are allowed).

use std::fmt;

use crate::frontmatter::{self, Value};
use crate::text;

/// Longest skill name, in bytes.
pub const MAX_NAME: usize = 64;
/// Longest description, in bytes.
pub const MAX_DESCRIPTION: usize = 1024;
/// Longest body, in bytes.
pub const MAX_BODY: usize = 256 * 1024;
/// Largest `SKILL.md` read at all (body plus frontmatter and its delimiters).
pub const MAX_FILE: usize = MAX_BODY + frontmatter::MAX_FRONTMATTER + 16;
/// Most skills in the index the agent sees.
pub const MAX_INDEX: usize = 256;

/// A parsed skill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skill {
    /// The name (equal to its directory's name).
    pub name: String,
    /// The one-line description.
    pub description: String,
    /// The instructions.
    pub body: String,
}

/// Why a `SKILL.md` was refused. The texts never quote the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkillError {
    /// Over [`MAX_FILE`] bytes.
    TooLarge,
    /// Not UTF-8.
    NotUtf8,
    /// A bidi, invisible or other unsafe character.
    UnsafeText(text::UnsafeChar),
    /// The frontmatter is malformed.
    Frontmatter(frontmatter::Error),
    /// A key other than `name` and `description` (line).
    UnknownKey(usize),
    /// A required key is missing.
    Missing(&'static str),
    /// A value is a list where a string belongs (line).
    NotAString(usize),
    /// The name breaks the grammar (ASCII letters, digits, `.`, `_`, `-`; at most 64 bytes).
    BadName,
    /// The name differs from the directory's name.
    NameMismatch,
    /// The description is empty, multi-line or over 1 KiB.
    BadDescription,
    /// The body is empty or over 256 KiB.
    BadBody,
}

impl fmt::Display for SkillError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkillError::TooLarge => write!(f, "SKILL.md is over {MAX_FILE} bytes"),
            SkillError::NotUtf8 => f.write_str("SKILL.md is not UTF-8"),
            SkillError::UnsafeText(c) => write!(f, "SKILL.md contains a forbidden character ({c})"),
            SkillError::Frontmatter(e) => write!(f, "frontmatter: {e}"),
            SkillError::UnknownKey(line) => {
                write!(
                    f,
                    "frontmatter line {line}: unknown key (only name and description)"
                )
            }
            SkillError::Missing(k) => write!(f, "frontmatter: {k} is required"),
            SkillError::NotAString(line) => write!(f, "frontmatter line {line}: expected a string"),
            SkillError::BadName => write!(
                f,
                "the name must be 1-{MAX_NAME} bytes of ASCII letters, digits, '.', '_' or '-'"
            ),
            SkillError::NameMismatch => f.write_str("the name differs from the directory's name"),
            SkillError::BadDescription => write!(
                f,
                "the description must be one non-empty line of at most {MAX_DESCRIPTION} bytes"
            ),
            SkillError::BadBody => {
                write!(f, "the body must be non-empty and at most {MAX_BODY} bytes")
            }
        }
    }
}

impl std::error::Error for SkillError {}

/// The grammar shared by skill names and agent names: ASCII letters, digits, `.`, `_`, `-`,
/// 1 to `max` bytes, case-sensitive.
pub fn name_ok(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        && s != "."
        && s != ".."
}

fn string(v: &Value, line: usize) -> Result<String, SkillError> {
    match v {
        Value::Scalar { text, .. } => Ok(text.clone()),
        Value::List(_) => Err(SkillError::NotAString(line)),
    }
}

/// Parse a `SKILL.md` found in the directory `dir_name`.
pub fn parse(bytes: &[u8], dir_name: &str) -> Result<Skill, SkillError> {
    let doc = frontmatter::decode(bytes, MAX_FILE).map_err(|e| match e {
        frontmatter::DecodeError::TooLarge => SkillError::TooLarge,
        frontmatter::DecodeError::NotUtf8 => SkillError::NotUtf8,
        frontmatter::DecodeError::UnsafeText(c) => SkillError::UnsafeText(c),
        frontmatter::DecodeError::Frontmatter(f) => SkillError::Frontmatter(f),
    })?;
    let (mut name, mut description) = (None, None);
    for e in &doc.entries {
        match e.key.as_str() {
            "name" => name = Some(string(&e.value, e.line)?),
            "description" => description = Some(string(&e.value, e.line)?),
            _ => return Err(SkillError::UnknownKey(e.line)),
        }
    }
    let name = name.ok_or(SkillError::Missing("name"))?;
    let description = description.ok_or(SkillError::Missing("description"))?;
    if !name_ok(&name, MAX_NAME) {
        return Err(SkillError::BadName);
    }
    if name != dir_name {
        return Err(SkillError::NameMismatch);
    }
    if description.trim().is_empty()
        || description.len() > MAX_DESCRIPTION
        || description.contains('\n')
    {
        return Err(SkillError::BadDescription);
    }
    if doc.body.trim().is_empty() || doc.body.len() > MAX_BODY {
        return Err(SkillError::BadBody);
    }
    Ok(Skill {
        name,
        description,
        body: doc.body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn skill(name: &str, desc: &str, body: &str) -> String {
        format!("---\nname: {name}\ndescription: {desc}\n---\n{body}")
    }

    #[test]
    fn a_plain_skill_parses() {
        let s = parse(
            skill("deploy", "How we deploy.", "Step 1.\n").as_bytes(),
            "deploy",
        )
        .unwrap();
        assert_eq!(
            (s.name.as_str(), s.description.as_str()),
            ("deploy", "How we deploy.")
        );
        assert_eq!(s.body, "Step 1.\n");
    }

    #[test]
    fn hostile_skills_are_refused_with_their_reason() {
        for (text, dir, cp, kind) in [
            (
                skill("a\u{202e}b", "d", "b"),
                "a\u{202e}b",
                0x202e,
                text::UnsafeKind::BidiControl,
            ),
            (
                skill("ok", "zero\u{200d}width", "b"),
                "ok",
                0x200d,
                text::UnsafeKind::Invisible,
            ),
            (
                skill("ok", "filler \u{3164}", "b"),
                "ok",
                0x3164,
                text::UnsafeKind::Invisible,
            ),
            (
                skill("ok", "d", "emoji \u{fe0f} body"),
                "ok",
                0xfe0f,
                text::UnsafeKind::Invisible,
            ),
        ] {
            match parse(text.as_bytes(), dir) {
                Err(SkillError::UnsafeText(c)) => assert_eq!((c.code_point, c.kind), (cp, kind)),
                other => panic!("{other:?}"),
            }
        }
        let cases: Vec<(String, &str, SkillError)> = vec![
            (skill("ok", "d", ""), "ok", SkillError::BadBody),
            (
                skill("ok", "", "b"),
                "ok",
                SkillError::Frontmatter(frontmatter::Error {
                    line: 3,
                    kind: frontmatter::ErrorKind::NoValue,
                }),
            ),
            (skill("ok", "d", "b"), "other", SkillError::NameMismatch),
            (skill("a/b", "d", "b"), "a/b", SkillError::BadName),
            (
                "---\nname: ok\ndescription: d\nextra: x\n---\nb".into(),
                "ok",
                SkillError::UnknownKey(4),
            ),
            (
                "---\nname: ok\n---\nb".into(),
                "ok",
                SkillError::Missing("description"),
            ),
            (
                "---\nname: [ok]\ndescription: d\n---\nb".into(),
                "ok",
                SkillError::NotAString(2),
            ),
            (
                skill("ok", &"d".repeat(MAX_DESCRIPTION + 1), "b"),
                "ok",
                SkillError::BadDescription,
            ),
        ];
        for (text, dir, want) in cases {
            assert_eq!(parse(text.as_bytes(), dir).unwrap_err(), want, "{text:?}");
        }
        // Bounds: the body at its limit is accepted, one byte more is refused.
        let at = skill("ok", "d", &"b".repeat(MAX_BODY));
        assert!(parse(at.as_bytes(), "ok").is_ok());
        let over = skill("ok", "d", &"b".repeat(MAX_BODY + 1));
        assert_eq!(
            parse(over.as_bytes(), "ok").unwrap_err(),
            SkillError::BadBody
        );
        assert_eq!(
            parse(&vec![b'x'; MAX_FILE + 1], "ok").unwrap_err(),
            SkillError::TooLarge
        );
        assert!(
            parse(
                skill(&"n".repeat(MAX_NAME), "d", "b").as_bytes(),
                &"n".repeat(MAX_NAME)
            )
            .is_ok()
        );
        let long = "n".repeat(MAX_NAME + 1);
        assert_eq!(
            parse(skill(&long, "d", "b").as_bytes(), &long).unwrap_err(),
            SkillError::BadName
        );
        iteron_test_support::record!("P5", serde_json::json!({}),);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn arbitrary_files_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400), s in "\\PC{0,200}") {
            let _ = parse(&bytes, "x");
            let _ = parse(format!("---\nname: x\ndescription: {s}\n---\n{s}").as_bytes(), "x");
        }

        #[test]
        fn unknown_keys_are_always_refused(key in "[a-zA-Z][a-zA-Z0-9_]{0,12}") {
            prop_assume!(key != "name" && key != "description");
            let text = format!("---\nname: x\ndescription: d\n{key}: v\n---\nbody");
            prop_assert_eq!(parse(text.as_bytes(), "x").unwrap_err(), SkillError::UnknownKey(4));
        }
    }
}
