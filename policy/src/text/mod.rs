//! Safe handling of untrusted text.
//!
//! Text that reaches Iteron from outside (configuration files, server responses, repository
//! files, error messages of other programs) is attacker-influenced. This module guards against
//! three ways such text can hurt the operator or an agent:
//!
//! * **Deceptive Unicode** ("Trojan Source" style attacks): bidirectional controls that reorder
//!   what is displayed, invisible (default-ignorable) characters that make two different
//!   identifiers look identical, format and private-use characters, unassigned code points and
//!   line/paragraph separators. [`check_untrusted`] rejects identifiers and display strings that
//!   contain any of them.
//! * **Terminal injection**: control characters (ESC sequences, carriage returns, NUL, DEL, C1
//!   controls such as NEL) that rewrite or hide what the operator sees, and newlines that forge
//!   extra log lines. [`single_line`] and [`single_line_capped`] render any string as one line of
//!   plain, visible text of bounded size.
//! * **Credential leaks**: tokens and passwords embedded in URLs, headers or error text that would
//!   otherwise be shown to an operator or handed to an agent. [`redact`] replaces them with
//!   `[REDACTED]`; the single-line renderers always redact first.
//!
//! # Character classes
//!
//! [`check_untrusted`] classifies each character in this order, reporting the first that
//! matches (so U+202E is a [`UnsafeKind::BidiControl`] and U+200B an [`UnsafeKind::Invisible`]):
//!
//! 1. `Bidi_Control` → [`UnsafeKind::BidiControl`];
//! 2. `Default_Ignorable_Code_Point` → [`UnsafeKind::Invisible`] (this includes ZWJ and variation
//!    selectors, so emoji *sequences* are rejected while single emoji pass);
//! 3. `General_Category`: `Cc` → [`UnsafeKind::Control`] (`'\n'` and `'\t'` are exempt when
//!    newlines are allowed, `'\r'` never is), `Cf` → [`UnsafeKind::Format`], `Co` →
//!    [`UnsafeKind::PrivateUse`], `Cn` (and `Cs`, which a `&str` cannot hold) →
//!    [`UnsafeKind::Unassigned`], `Zl`/`Zp` → [`UnsafeKind::LineSeparator`].
//!
//! # Redaction rules
//!
//! [`redact`] scans plain bytes (no regular expressions) and replaces each match with
//! `[REDACTED]`. *Token characters* are ASCII alphanumerics and `- _ . ~ + / =`.
//!
//! 1. **Key/value pairs**: `key=value`, `key: value`, `key = "value"`, `"key":"value"` and the
//!    backslash-escaped JSON form `\"key\":\"value\"`. The key is the run of ASCII alphanumerics,
//!    `_`, `-` and `.` before the separator (so URL query parameters and `--flag=value` are
//!    covered). It is sensitive when, lowercased with `_`, `-` and `.` removed, it contains one
//!    of `token`, `secret`, `password`, `passwd`, `passphrase`, `pwd`, `apikey`, `authorization`,
//!    `credential`, `privatekey`, `session`, `cookie`, `codeverifier`, `clientsecret`,
//!    `refresh` or `accesskey` (so `api_key`, `api-key`, `x_api_key`, `privateKey`,
//!    `ITERON_MCP_ACCESS_TOKEN` all match), or when one of its segments (split at punctuation,
//!    lower→upper case changes and letter/digit changes) is exactly `auth`.
//!    * An unquoted value ends at ASCII whitespace, `&`, `,`, `;`, a quote or the end; a quoted
//!      value runs to its closing quote (honouring backslash escapes) or the end of the line, so
//!      quoted passphrases with spaces are covered whole.
//!    * For header-like keys (containing `authorization` or `cookie`) written `Key: value`, the
//!      unquoted value runs to the end of the line, so every cookie of a `Cookie:` header goes.
//!    * For authorization keys (containing `authorization`, or with an `auth` segment) a leading
//!      scheme word (`Bearer`, `Basic`, `Digest`, `Token`, `Negotiate`, `NTLM`) is kept and the
//!      credential after it is redacted.
//!    * A value starting with `{` is left alone (its nested keys are judged on their own); a
//!      key matched only through the plural `tokens` (`max_tokens`, `prompt_tokens`) keeps a
//!      purely numeric value, because that is a count; `tokenizer`/`tokenise`/`tokenization`
//!      are not credentials at all.
//!    * `a::b`, `scheme://`, `==`, `!=`, `<=` and `>=` are not separators.
//! 2. **Authorization schemes anywhere**: `Bearer <token>` and `Basic <token>` (scheme word
//!    case-insensitive) keep the scheme word and redact the token run after it, unless that
//!    run is an ordinary prose word (only letters, nothing uppercase after the first, shorter
//!    than 20, ignoring trailing `=`), so "Bearer tokens are..." or `Bearer realm="x"` stay.
//! 3. **URL userinfo**: `scheme://user:pass@host` becomes `scheme://[REDACTED]@host`. A userinfo
//!    without `:` (`ssh://git@host`) is kept: it names an account, not a secret.
//! 4. **Well-known token shapes**, starting at the beginning of a token run or after a
//!    non-alphanumeric character inside one, and redacted to the end of the run: `ghp_`, `gho_`,
//!    `ghu_`, `ghs_`, `ghr_`, `github_pat_` (each + ≥ 16 word characters); `glpat-` (+ ≥ 16);
//!    `xoxb-`/`xoxp-`/`xoxa-`/`xoxr-` (+ ≥ 10); `sk-` + ≥ 16 token characters (covers `sk-ant-`,
//!    `sk-proj-`, `sk-live-`); `AKIA`/`ASIA` + 16 uppercase letters or digits; `npm_` + 36
//!    alphanumerics; `AIza` + 35 characters; JWT-like `eyJ…`.`…`.`…` (three base64url
//!    segments, the third possibly empty).
//! 5. **Random blobs**: any other run of ≥ 40 token characters (split at `=` so `KEY=value`
//!    keeps its key; trailing `=` padding stays with the blob) that contains both letters and
//!    digits *and* changes character class (lowercase / uppercase / digit) between neighbours at
//!    least once per four characters. That cheap entropy test catches base64 and hex secrets
//!    (including 40-hex commit ids, which look exactly like legacy tokens) but keeps paths such
//!    as `/usr/local/lib/x86_64-linux-gnu/libssl.so.3`, dotted names and UUIDs (36 characters)
//!    visible.
//!
//! A trailing `.` is never part of a token-shaped match (it ends sentences). Overlapping or
//! adjacent matches collapse into one `[REDACTED]`. Redaction is repeated until nothing more
//! matches (bounded), so `redact(redact(x)) == redact(x)`.
//!
//! **`auth` versus `author`**: `auth` is only sensitive as a whole key segment (`auth`,
//! `x-auth`, `AUTH_HEADER`, `authKey`), never as a substring, so `author: Jane`,
//! `authority=...` and `authentication: failed` are left intact. `authorization` is matched as
//! a substring as usual.
//!
//! # Escape scheme
//!
//! [`single_line_capped`] escapes, after redaction, using Rust-like ASCII escapes:
//! `\` → `\\`, line feed → `\n`, carriage return → `\r`, tab → `\t`, and every other character
//! [`check_untrusted`] rejects (with newlines disallowed) → `\u{hex}` with lowercase hex and no
//! leading zeros (`\u{1b}`, `\u{202e}`, `\u{e0041}`). Because `\` itself is escaped, the
//! rendering is unambiguous. When the line is too long it is cut between two escape units and
//! ends with `…` (U+2026).
//!
//! The code is split by concern: `unicode` (the character classes), `redaction` (the redaction
//! rules, one submodule per rule), `line` (the escape scheme and the single-line renderers) and
//! `terminal_json` (JSON output that a terminal shows only as visible characters). Every public
//! item is re-exported here, so callers name it `iteron_policy::text::X`.
//!
//! Nothing here performs I/O.

mod line;
mod redaction;
mod terminal_json;
mod unicode;

#[cfg(test)]
mod strategies;

pub use line::{
    Capped, MAX_LINE_BYTES, cap_rendered, escape_capped, escape_capped_counted, single_line,
    single_line_capped,
};
pub use redaction::redact;
pub use terminal_json::{json_terminal_safe, terminal_safe_json};
pub use unicode::{UnsafeChar, UnsafeKind, check_untrusted};
