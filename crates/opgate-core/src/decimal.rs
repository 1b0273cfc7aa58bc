//! Exact decimal numbers.
//!
//! opgate never routes an argument through `f64`: JSON numbers arrive as their exact
//! decimal text (serde_json's `arbitrary_precision`), are parsed here into a sign, a
//! digit string and a scale, and are written back in one canonical spelling. `49`,
//! `49.0`, `49.00` and `4.9e1` are the same number and canonicalize to `49`.

use std::fmt;

/// Largest decimal exponent accepted; `1e1000000` would otherwise expand to a million digits.
const MAX_EXPONENT: i64 = 64;
/// Most significant digits accepted in one number.
const MAX_DIGITS: usize = 64;

/// An exact decimal: `(-1)^negative * digits * 10^-scale`, always normalized
/// (no leading zeros, no trailing fractional zeros, zero is never negative).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decimal {
    negative: bool,
    /// Decimal digits without leading zeros; `"0"` for zero.
    digits: String,
    /// Number of digits after the decimal point.
    scale: u32,
}

/// Why a text is not an exact decimal opgate accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecimalError {
    /// The text is not a plain decimal number.
    #[error("not a decimal number: {0:?}")]
    Syntax(String),
    /// The number has an exponent or digit count that cannot be kept exactly.
    #[error("number {0:?} is out of the exactly representable range")]
    OutOfRange(String),
}

impl Decimal {
    /// Parses a JSON number literal (sign, digits, optional fraction, optional exponent).
    pub fn parse_json(text: &str) -> Result<Self, DecimalError> {
        Self::parse(text, true)
    }

    /// Parses a plain decimal string such as `"49.00"` or `"-3"` (no exponent, no `+`).
    pub fn parse_plain(text: &str) -> Result<Self, DecimalError> {
        Self::parse(text, false)
    }

    fn parse(text: &str, allow_exponent: bool) -> Result<Self, DecimalError> {
        let syntax = || DecimalError::Syntax(text.to_owned());
        let (negative, rest) = match text.strip_prefix('-') {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (mantissa, exponent) = match rest.find(['e', 'E']) {
            Some(at) if allow_exponent => {
                let exp_text = &rest[at + 1..];
                let exp: i64 = exp_text.parse().map_err(|_| syntax())?;
                if exp.abs() > MAX_EXPONENT {
                    return Err(DecimalError::OutOfRange(text.to_owned()));
                }
                (&rest[..at], exp)
            }
            Some(_) => return Err(syntax()),
            None => (rest, 0),
        };
        let (int_part, frac_part) = match mantissa.split_once('.') {
            Some((i, f)) => (i, f),
            None => (mantissa, ""),
        };
        let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
        if int_part.is_empty()
            || !all_digits(int_part)
            || !all_digits(frac_part)
            || (mantissa.contains('.') && frac_part.is_empty())
        {
            return Err(syntax());
        }
        let mut digits = format!("{int_part}{frac_part}");
        let mut scale = frac_part.len() as i64 - exponent;
        if scale < 0 {
            digits.extend(std::iter::repeat_n('0', (-scale) as usize));
            scale = 0;
        }
        Self::normalized(negative, digits, scale as u32, text)
    }

    fn normalized(
        negative: bool,
        mut digits: String,
        mut scale: u32,
        text: &str,
    ) -> Result<Self, DecimalError> {
        while scale > 0 && digits.ends_with('0') {
            digits.pop();
            scale -= 1;
        }
        let trimmed = digits.trim_start_matches('0');
        let digits = if trimmed.is_empty() {
            "0".to_owned()
        } else {
            trimmed.to_owned()
        };
        if digits.len() > MAX_DIGITS || scale as usize > MAX_DIGITS {
            return Err(DecimalError::OutOfRange(text.to_owned()));
        }
        let negative = negative && digits != "0";
        let scale = if digits == "0" { 0 } else { scale };
        Ok(Self {
            negative,
            digits,
            scale,
        })
    }

    /// True when the number has no fractional part.
    pub fn is_integer(&self) -> bool {
        self.scale == 0
    }

    /// Number of digits after the decimal point in the normalized form.
    pub fn scale(&self) -> u32 {
        self.scale
    }

    /// The value multiplied by `10^exponent` as an exact integer, or `None` when that
    /// product has a fractional part or does not fit in an `i64`.
    pub fn scaled_integer(&self, exponent: u32) -> Option<i64> {
        if self.scale > exponent {
            return None;
        }
        let zeros = (exponent - self.scale) as usize;
        let mut text = String::with_capacity(self.digits.len() + zeros + 1);
        if self.negative {
            text.push('-');
        }
        text.push_str(&self.digits);
        text.extend(std::iter::repeat_n('0', zeros));
        text.parse().ok()
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.negative {
            f.write_str("-")?;
        }
        let scale = self.scale as usize;
        if scale == 0 {
            return f.write_str(&self.digits);
        }
        if self.digits.len() > scale {
            let (int, frac) = self.digits.split_at(self.digits.len() - scale);
            write!(f, "{int}.{frac}")
        } else {
            let zeros = "0".repeat(scale - self.digits.len());
            write!(f, "0.{zeros}{}", self.digits)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        Decimal::parse_json(text).expect("valid").to_string()
    }

    #[test]
    fn equivalent_spellings_share_one_form() {
        for text in ["49", "49.0", "49.00", "4.9e1", "4.9E+1", "490e-1", "0049"] {
            assert_eq!(canon(text), "49", "{text}");
        }
        assert_eq!(canon("0.10"), "0.1");
        assert_eq!(canon("-0.0"), "0");
        assert_eq!(canon("5e-3"), "0.005");
        assert_eq!(canon("-12.340"), "-12.34");
    }

    #[test]
    fn rejects_what_cannot_be_exact_or_is_not_a_number() {
        assert!(matches!(
            Decimal::parse_json("1e400"),
            Err(DecimalError::OutOfRange(_))
        ));
        assert!(matches!(
            Decimal::parse_json(&"9".repeat(80)),
            Err(DecimalError::OutOfRange(_))
        ));
        for bad in ["", "-", "1.", ".5", "1e", "abc", "1,5", "+1"] {
            assert!(Decimal::parse_json(bad).is_err(), "{bad:?}");
        }
        assert!(Decimal::parse_plain("4.9e1").is_err());
    }

    #[test]
    fn scaled_integer_is_exact_or_nothing() {
        let d = Decimal::parse_plain("49.5").expect("valid");
        assert_eq!(d.scaled_integer(2), Some(4950));
        assert_eq!(d.scaled_integer(0), None);
        assert_eq!(
            Decimal::parse_plain("-0.01")
                .expect("valid")
                .scaled_integer(2),
            Some(-1)
        );
        assert_eq!(
            Decimal::parse_plain("99999999999999999999")
                .expect("valid")
                .scaled_integer(2),
            None
        );
    }
}
