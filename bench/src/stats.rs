//! Medians, spreads and percentiles: every figure is reported as the median of several
//! runs with their min and max.

use std::time::Instant;

/// Several runs' values of one figure.
#[derive(Debug, Clone, Default)]
pub struct Runs(pub Vec<f64>);

impl Runs {
    pub fn push(&mut self, value: f64) {
        self.0.push(value);
    }

    pub fn median(&self) -> f64 {
        percentile_f64(&self.0, 0.5)
    }

    pub fn min(&self) -> f64 {
        self.0.iter().copied().fold(f64::INFINITY, f64::min)
    }

    pub fn max(&self) -> f64 {
        self.0.iter().copied().fold(f64::NEG_INFINITY, f64::max)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The `q` quantile (0..=1) by nearest rank; NaN for no values.
pub fn percentile_f64(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// "12,345" style thousands for rates and counts, "1.23" for small values.
pub fn fmt_num(value: f64) -> String {
    if !value.is_finite() {
        return "–".into();
    }
    if value.abs() >= 100.0 {
        let n = value.round() as i64;
        let digits = n.abs().to_string();
        let mut out = String::new();
        for (i, c) in digits.chars().enumerate() {
            if i > 0 && (digits.len() - i).is_multiple_of(3) {
                out.push(',');
            }
            out.push(c);
        }
        if n < 0 {
            out.insert(0, '-');
        }
        out
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// A ratio as "3.4×".
pub fn fmt_ratio(value: f64) -> String {
    if !value.is_finite() {
        return "–".into();
    }
    if value >= 10.0 {
        format!("{value:.0}×")
    } else {
        format!("{value:.2}×")
    }
}

/// "12,345 (11,000–13,000)".
pub fn cell(runs: &Runs) -> String {
    if runs.is_empty() {
        return "–".into();
    }
    if runs.0.len() == 1 {
        return fmt_num(runs.median());
    }
    format!(
        "{} ({}–{})",
        fmt_num(runs.median()),
        fmt_num(runs.min()),
        fmt_num(runs.max())
    )
}

/// `to − from` in ms, negative when `to` came first.
pub fn signed_ms(from: Instant, to: Instant) -> f64 {
    if to >= from {
        (to - from).as_secs_f64() * 1e3
    } else {
        -((from - to).as_secs_f64() * 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles_by_nearest_rank() {
        let runs = Runs(vec![5.0, 1.0, 3.0]);
        assert_eq!(runs.median(), 3.0);
        assert_eq!(runs.min(), 1.0);
        assert_eq!(runs.max(), 5.0);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile_f64(&v, 0.99), 99.0);
        assert_eq!(percentile_f64(&v, 0.5), 50.0);
    }

    #[test]
    fn numbers_read_well() {
        assert_eq!(fmt_num(1234567.0), "1,234,567");
        assert_eq!(fmt_num(12.34), "12.3");
        assert_eq!(fmt_ratio(3.456), "3.46×");
    }
}
