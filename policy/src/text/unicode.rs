//! Deceptive Unicode: the character classes [`check_untrusted`] rejects in identifiers and
//! display strings (the order is specified under "Character classes" in the parent module).

use std::fmt;

use icu_properties::props::{BidiControl, DefaultIgnorableCodePoint, GeneralCategory};
use icu_properties::{
    CodePointMapData, CodePointMapDataBorrowed, CodePointSetData, CodePointSetDataBorrowed,
};

const BIDI_CONTROL: CodePointSetDataBorrowed<'static> = CodePointSetData::new::<BidiControl>();
const DEFAULT_IGNORABLE: CodePointSetDataBorrowed<'static> =
    CodePointSetData::new::<DefaultIgnorableCodePoint>();
const GENERAL_CATEGORY: CodePointMapDataBorrowed<'static, GeneralCategory> =
    CodePointMapData::<GeneralCategory>::new();

/// Why a character is unsafe to show or to accept in an identifier or display string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnsafeKind {
    /// `Bidi_Control`: reorders displayed text (RLO, RLI, LRM, ALM, ...).
    BidiControl,
    /// `Default_Ignorable_Code_Point`: normally rendered as nothing (ZWSP, ZWJ, BOM, soft hyphen,
    /// variation selectors, tag characters, Hangul fillers, ...).
    Invisible,
    /// General category `Control` (C0, DEL, C1 including NEL U+0085).
    Control,
    /// General category `Format` that is not already bidi or default-ignorable.
    Format,
    /// General category `Private_Use`: meaning depends on the font.
    PrivateUse,
    /// General category `Unassigned` (including noncharacters): meaning may change later.
    Unassigned,
    /// U+2028 LINE SEPARATOR or U+2029 PARAGRAPH SEPARATOR.
    LineSeparator,
}

impl UnsafeKind {
    fn describe(self) -> &'static str {
        match self {
            Self::BidiControl => "bidirectional control",
            Self::Invisible => "invisible character",
            Self::Control => "control character",
            Self::Format => "format character",
            Self::PrivateUse => "private-use character",
            Self::Unassigned => "unassigned code point",
            Self::LineSeparator => "line or paragraph separator",
        }
    }
}

/// The first unsafe character found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsafeChar {
    /// Byte offset of the character in the checked string.
    pub offset: usize,
    /// The character's code point.
    pub code_point: u32,
    /// Why it is unsafe.
    pub kind: UnsafeKind,
}

impl fmt::Display for UnsafeChar {
    /// Names the kind, code point and byte offset, e.g. `bidirectional control U+202E at byte 4`;
    /// never prints the character itself.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} U+{:04X} at byte {}",
            self.kind.describe(),
            self.code_point,
            self.offset
        )
    }
}

impl std::error::Error for UnsafeChar {}

/// Classifies one character; `None` means it is safe to show.
pub(super) fn classify(c: char, allow_newlines: bool) -> Option<UnsafeKind> {
    if (' '..='~').contains(&c) || (allow_newlines && (c == '\n' || c == '\t')) {
        return None;
    }
    if BIDI_CONTROL.contains(c) {
        return Some(UnsafeKind::BidiControl);
    }
    if DEFAULT_IGNORABLE.contains(c) {
        return Some(UnsafeKind::Invisible);
    }
    match GENERAL_CATEGORY.get(c) {
        GeneralCategory::Control => Some(UnsafeKind::Control),
        GeneralCategory::Format => Some(UnsafeKind::Format),
        GeneralCategory::PrivateUse => Some(UnsafeKind::PrivateUse),
        // A `char` is never a surrogate; kept so the mapping stays total.
        GeneralCategory::Unassigned | GeneralCategory::Surrogate => Some(UnsafeKind::Unassigned),
        GeneralCategory::LineSeparator | GeneralCategory::ParagraphSeparator => {
            Some(UnsafeKind::LineSeparator)
        }
        _ => None,
    }
}

/// Reject untrusted text containing any `Bidi_Control`, `Default_Ignorable_Code_Point`, or
/// character of general category Control, Format, Private_Use, Unassigned, Surrogate, or
/// Line/Paragraph separator.
///
/// Checks run in that order (bidi, then default-ignorable, then category), so U+202E reports
/// [`UnsafeKind::BidiControl`] and U+200B reports [`UnsafeKind::Invisible`]. When
/// `allow_newlines` is false, `'\n'`, `'\r'` and `'\t'` are [`UnsafeKind::Control`] errors; when
/// it is true, `'\n'` and `'\t'` are allowed (`'\r'` never is). The error carries the byte offset
/// of the first offending character.
pub fn check_untrusted(s: &str, allow_newlines: bool) -> Result<(), UnsafeChar> {
    for (offset, c) in s.char_indices() {
        if let Some(kind) = classify(c, allow_newlines) {
            return Err(UnsafeChar {
                offset,
                code_point: u32::from(c),
                kind,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::strategies::any_text;
    use proptest::prelude::*;

    fn kind_of(s: &str) -> Option<UnsafeKind> {
        check_untrusted(s, false).err().map(|e| e.kind)
    }

    fn assert_kind(chars: &[char], kind: UnsafeKind) {
        for &c in chars {
            let s = format!("ab{c}cd");
            let err = check_untrusted(&s, true).expect_err("must be rejected");
            assert_eq!(err.kind, kind, "U+{:04X}", u32::from(c));
            assert_eq!(err.offset, 2);
            assert_eq!(err.code_point, u32::from(c));
        }
    }

    #[test]
    fn bidi_controls_are_reported_as_bidi_control() {
        assert_kind(
            &[
                '\u{202E}', '\u{2067}', '\u{200E}', '\u{061C}', '\u{202A}', '\u{2069}',
            ],
            UnsafeKind::BidiControl,
        );
    }

    #[test]
    fn default_ignorable_characters_are_reported_as_invisible() {
        assert_kind(
            &[
                '\u{200B}',
                '\u{200D}',
                '\u{FEFF}',
                '\u{00AD}',
                '\u{FE0F}',
                '\u{E0041}',
                '\u{3164}',
                '\u{2060}',
            ],
            UnsafeKind::Invisible,
        );
    }

    #[test]
    fn control_characters_are_reported_as_control() {
        assert_kind(
            &['\u{1B}', '\0', '\u{7F}', '\u{85}', '\r'],
            UnsafeKind::Control,
        );
    }

    #[test]
    fn private_use_is_reported() {
        assert_kind(
            &['\u{E000}', '\u{F8FF}', '\u{10FFFD}'],
            UnsafeKind::PrivateUse,
        );
    }

    #[test]
    fn unassigned_code_points_are_reported() {
        assert_kind(
            &['\u{0378}', '\u{FFFF}', '\u{FDD0}'],
            UnsafeKind::Unassigned,
        );
    }

    #[test]
    fn line_and_paragraph_separators_are_reported() {
        assert_kind(&['\u{2028}', '\u{2029}'], UnsafeKind::LineSeparator);
    }

    #[test]
    fn format_characters_that_are_visible_elsewhere_are_reported_as_format() {
        // U+0600 ARABIC NUMBER SIGN is Cf but neither bidi control nor default-ignorable.
        assert_kind(&['\u{0600}', '\u{FFF9}'], UnsafeKind::Format);
    }

    #[test]
    fn ordinary_text_passes() {
        for s in [
            "",
            "plain ASCII with punctuation !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
            "Crème brûlée à la française, Ærøskøbing, Łódź",
            "中文字符 日本語 한국어",
            "emoji \u{1F600} \u{1F383}",
            "Ελληνικά и кириллица",
        ] {
            assert_eq!(check_untrusted(s, false), Ok(()), "{s}");
        }
    }

    #[test]
    fn newline_and_tab_are_allowed_only_when_requested() {
        assert_eq!(check_untrusted("a\nb\tc", true), Ok(()));
        let err = check_untrusted("a\nb", false).expect_err("newline rejected");
        assert_eq!(
            (err.kind, err.offset, err.code_point),
            (UnsafeKind::Control, 1, 0x0A)
        );
        let err = check_untrusted("ab\tc", false).expect_err("tab rejected");
        assert_eq!((err.kind, err.offset), (UnsafeKind::Control, 2));
    }

    #[test]
    fn carriage_return_is_rejected_even_when_newlines_are_allowed() {
        let err = check_untrusted("line\r\n", true).expect_err("CR rejected");
        assert_eq!((err.kind, err.offset), (UnsafeKind::Control, 4));
    }

    #[test]
    fn offsets_are_byte_offsets_of_the_first_unsafe_char() {
        let err = check_untrusted("é中\u{202E}\u{200B}", false).expect_err("rejected");
        assert_eq!(err.offset, 5);
        assert_eq!(err.kind, UnsafeKind::BidiControl);
    }

    #[test]
    fn display_names_the_code_point_without_printing_it() {
        let err = check_untrusted("abcd\u{202E}x", false).expect_err("rejected");
        let shown = err.to_string();
        assert_eq!(shown, "bidirectional control U+202E at byte 4");
        assert!(!shown.contains('\u{202E}'));
        let err = check_untrusted("\u{E0041}", false).expect_err("rejected");
        assert_eq!(err.to_string(), "invisible character U+E0041 at byte 0");
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert!(boxed.to_string().starts_with("invisible"));
    }

    #[test]
    fn zwj_emoji_sequences_are_rejected_but_single_emoji_pass() {
        assert_eq!(
            kind_of("\u{1F468}\u{200D}\u{1F4BB}"),
            Some(UnsafeKind::Invisible)
        );
        assert_eq!(kind_of("\u{1F468}\u{1F4BB}"), None);
    }

    proptest! {
        #[test]
        fn check_untrusted_never_panics_and_reports_a_real_char(s in any_text(), nl in any::<bool>()) {
            if let Err(e) = check_untrusted(&s, nl) {
                let c = s[e.offset..].chars().next();
                prop_assert_eq!(c.map(u32::from), Some(e.code_point));
                prop_assert!(!e.to_string().is_empty());
            }
        }
    }
}
