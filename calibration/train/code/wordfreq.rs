//! wordfreq: count word frequencies in text files.
//!
//! Reads one or more files (or standard input when no paths are given),
//! splits the text into lowercase words, and prints the most common ones.
//!
//! ```text
//! $ wordfreq --top 5 --min-len 4 notes.txt essay.txt
//!    412  that
//!    230  with
//!    198  this
//!    151  from
//!    149  have
//! ```

use std::collections::HashMap;
use std::env;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Write};
use std::process::ExitCode;

/// Command line options after parsing.
#[derive(Debug, Clone, PartialEq)]
struct Options {
    top: usize,
    min_len: usize,
    stop_words: bool,
    paths: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options { top: 20, min_len: 1, stop_words: false, paths: Vec::new() }
    }
}

/// A short list of very common English words that can be skipped with `--no-stop`.
const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "is",
    "it", "of", "on", "or", "so", "that", "the", "to", "was", "with",
];

fn parse_args<I: Iterator<Item = String>>(mut args: I) -> Result<Options, String> {
    let mut opts = Options::default();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--top" | "-n" => {
                let value = args.next().ok_or("--top needs a number")?;
                opts.top = value.parse().map_err(|_| format!("bad --top value: {value}"))?;
            }
            "--min-len" => {
                let value = args.next().ok_or("--min-len needs a number")?;
                opts.min_len = value.parse().map_err(|_| format!("bad --min-len value: {value}"))?;
            }
            "--no-stop" => opts.stop_words = true,
            "-h" | "--help" => return Err(String::from("usage: wordfreq [--top N] [--min-len N] [--no-stop] [FILE...]")),
            other if other.starts_with('-') => return Err(format!("unknown option {other}")),
            path => opts.paths.push(path.to_string()),
        }
    }
    Ok(opts)
}

/// Split a line into words: runs of letters, digits and apostrophes.
/// Leading and trailing apostrophes are trimmed so quotes do not count.
fn words(line: &str) -> impl Iterator<Item = String> + '_ {
    line.split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .map(|w| w.trim_matches('\''))
        .filter(|w| !w.is_empty())
        .map(|w| w.to_lowercase())
}

#[derive(Default)]
struct Counter {
    counts: HashMap<String, u64>,
    total: u64,
}

impl Counter {
    fn add_reader<R: BufRead>(&mut self, reader: R, opts: &Options) -> io::Result<()> {
        for line in reader.lines() {
            let line = line?;
            for word in words(&line) {
                if word.chars().count() < opts.min_len {
                    continue;
                }
                if opts.stop_words && STOP_WORDS.contains(&word.as_str()) {
                    continue;
                }
                self.total += 1;
                *self.counts.entry(word).or_insert(0) += 1;
            }
        }
        Ok(())
    }

    /// Most frequent words first; ties broken alphabetically so output is stable.
    fn top(&self, n: usize) -> Vec<(&str, u64)> {
        let mut items: Vec<(&str, u64)> =
            self.counts.iter().map(|(w, c)| (w.as_str(), *c)).collect();
        items.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        items.truncate(n);
        items
    }
}

fn run(opts: &Options) -> io::Result<Counter> {
    let mut counter = Counter::default();
    if opts.paths.is_empty() {
        let stdin = io::stdin();
        counter.add_reader(stdin.lock(), opts)?;
    } else {
        for path in &opts.paths {
            let file = File::open(path)
                .map_err(|e| io::Error::new(e.kind(), format!("{path}: {e}")))?;
            counter.add_reader(BufReader::new(file), opts)?;
        }
    }
    Ok(counter)
}

fn main() -> ExitCode {
    let opts = match parse_args(env::args().skip(1)) {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    let counter = match run(&opts) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("wordfreq: {err}");
            return ExitCode::FAILURE;
        }
    };

    let stdout = io::stdout();
    let mut out = stdout.lock();
    for (word, count) in counter.top(opts.top) {
        // Ignore broken pipes, e.g. when piped into `head`.
        if writeln!(out, "{count:>7}  {word}").is_err() {
            break;
        }
    }
    eprintln!("{} words, {} distinct", counter.total, counter.counts.len());
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_on_punctuation_and_lowercases() {
        let got: Vec<String> = words("Hello, world! It's 'quoted' text.").collect();
        assert_eq!(got, vec!["hello", "world", "it's", "quoted", "text"]);
    }

    #[test]
    fn counts_and_orders_ties_alphabetically() {
        let opts = Options::default();
        let mut c = Counter::default();
        c.add_reader("b a b c a".as_bytes(), &opts).unwrap();
        assert_eq!(c.top(3), vec![("a", 2), ("b", 2), ("c", 1)]);
        assert_eq!(c.total, 5);
    }

    #[test]
    fn parses_options() {
        let args = ["--top", "3", "--no-stop", "x.txt"].map(String::from);
        let opts = parse_args(args.into_iter()).unwrap();
        assert_eq!(opts.top, 3);
        assert!(opts.stop_words);
        assert_eq!(opts.paths, vec!["x.txt"]);
    }

    #[test]
    fn rejects_unknown_flag() {
        assert!(parse_args(["--bogus".to_string()].into_iter()).is_err());
    }
}
