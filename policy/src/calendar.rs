//! The Gregorian calendar, as far as the date checks of forms (`format: date`, `date-time`)
//! and the expiry of approval rules need it.

/// Whether `year` is a leap year.
pub fn is_leap(year: u64) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

/// How many days `month` (1 to 12) of `year` has; `None` for a month that does not exist.
pub fn days_in_month(year: u64, month: u64) -> Option<u64> {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => Some(31),
        4 | 6 | 9 | 11 => Some(30),
        2 if is_leap(year) => Some(29),
        2 => Some(28),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn february_follows_the_gregorian_leap_rule_and_no_month_thirteen_exists() {
        assert_eq!(days_in_month(2024, 2), Some(29));
        assert_eq!(days_in_month(2023, 2), Some(28));
        assert_eq!(days_in_month(1900, 2), Some(28));
        assert_eq!(days_in_month(2000, 2), Some(29));
        assert_eq!(days_in_month(2023, 4), Some(30));
        assert_eq!(days_in_month(2023, 12), Some(31));
        assert_eq!(days_in_month(2023, 0), None);
        assert_eq!(days_in_month(2023, 13), None);
        let year: u64 = (1..=12).filter_map(|m| days_in_month(2023, m)).sum();
        assert_eq!(year, 365);
        let leap: u64 = (1..=12).filter_map(|m| days_in_month(2024, m)).sum();
        assert_eq!(leap, 366);
    }
}
