//! Tests of the text-format parser: accepted forms, escapes, and every
//! syntax error with its line number.

use super::*;

fn sample(name: &str, labels: &[(&str, &str)], value: f64) -> Sample {
    Sample {
        name: name.to_owned(),
        labels: labels.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect(),
        value,
    }
}

/// Compare as bits so NaN == NaN and -0.0 != 0.0.
fn assert_samples(case: &str, got: &[Sample], want: &[Sample]) {
    assert_eq!(got.len(), want.len(), "{case}: sample count; got {got:?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.name, w.name, "{case}");
        assert_eq!(g.labels, w.labels, "{case}");
        assert_eq!(g.value.to_bits(), w.value.to_bits(), "{case}: value of {}: {} vs {}", g.name, g.value, w.value);
    }
}

#[test]
fn accepted_lines() {
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let cases: &[(&str, &str, Vec<Sample>)] = &[
        ("empty body", "", vec![]),
        ("only a newline", "\n", vec![]),
        ("blank and whitespace-only lines", "\n \n\t\n  \t  \n", vec![]),
        (
            "comments of every kind",
            "# HELP foo Some help with \\\\ and \\n escapes.\n# TYPE foo gauge\n#\n#free comment\n   # indented comment\n# HELP\n",
            vec![],
        ),
        ("bare name", "foo 1", vec![sample("foo", &[], 1.0)]),
        ("colons in names", "vllm:num_requests_running 3", vec![sample("vllm:num_requests_running", &[], 3.0)]),
        ("leading colon and underscore", ":_a:b_9 2", vec![sample(":_a:b_9", &[], 2.0)]),
        ("empty label set", "foo{} 4", vec![sample("foo", &[], 4.0)]),
        ("empty label set, no blank before value", "foo{}4", vec![sample("foo", &[], 4.0)]),
        ("one label", r#"foo{a="x"} 5"#, vec![sample("foo", &[("a", "x")], 5.0)]),
        (
            "labels keep their order",
            r#"foo{z="1",a="2",m="3"} 6"#,
            vec![sample("foo", &[("z", "1"), ("a", "2"), ("m", "3")], 6.0)],
        ),
        ("trailing comma", r#"foo{a="x",} 7"#, vec![sample("foo", &[("a", "x")], 7.0)]),
        (
            "blanks everywhere they are allowed",
            "  foo \t{ a = \"x\" ,\tb=\"y\" , }  8  \t",
            vec![sample("foo", &[("a", "x"), ("b", "y")], 8.0)],
        ),
        ("empty label value", r#"foo{a=""} 9"#, vec![sample("foo", &[("a", "")], 9.0)]),
        (
            "escapes in label values",
            r#"foo{path="C:\\dir\\",quote="say \"hi\"",nl="a\nb",all="\\\"\n"} 1"#,
            vec![sample(
                "foo",
                &[("path", "C:\\dir\\"), ("quote", "say \"hi\""), ("nl", "a\nb"), ("all", "\\\"\n")],
                1.0,
            )],
        ),
        (
            "delimiters inside label values",
            r#"foo{a="x}, y=\"z\" # 1 2",b="{"} 10"#,
            vec![sample("foo", &[("a", "x}, y=\"z\" # 1 2"), ("b", "{")], 10.0)],
        ),
        (
            "UTF-8 in label values",
            "foo{model=\"Qwen/Qwen2.5—中文 🚀\"} 11",
            vec![sample("foo", &[("model", "Qwen/Qwen2.5—中文 🚀")], 11.0)],
        ),
        ("timestamp", "foo 1 1712345678901", vec![sample("foo", &[], 1.0)]),
        ("negative timestamp", "foo 2 -1", vec![sample("foo", &[], 2.0)]),
        ("timestamp after labels, trailing blanks", "foo{a=\"b\"} 3 1712345678901  ", vec![sample("foo", &[("a", "b")], 3.0)]),
        ("tab separators", "foo\t4\t1712345678901", vec![sample("foo", &[], 4.0)]),
        ("NaN", "foo NaN", vec![sample("foo", &[], nan)]),
        ("+Inf", "foo +Inf", vec![sample("foo", &[], inf)]),
        ("-Inf", "foo -Inf", vec![sample("foo", &[], -inf)]),
        ("Inf without sign", "foo Inf", vec![sample("foo", &[], inf)]),
        ("case-insensitive specials", "a nan\nb +inf\nc -INF", vec![sample("a", &[], nan), sample("b", &[], inf), sample("c", &[], -inf)]),
        ("scientific notation", "foo 1.3035470848e+010", vec![sample("foo", &[], 13_035_470_848.0)]),
        ("scientific, upper case, negative exponent", "foo 2.5E-3", vec![sample("foo", &[], 0.0025)]),
        ("integer", "foo 42", vec![sample("foo", &[], 42.0)]),
        ("negative", "foo -3.5", vec![sample("foo", &[], -3.5)]),
        ("explicit plus", "foo +7", vec![sample("foo", &[], 7.0)]),
        ("negative zero", "foo -0", vec![sample("foo", &[], -0.0)]),
        ("leading dot", "foo .5", vec![sample("foo", &[], 0.5)]),
        ("trailing dot", "foo 5.", vec![sample("foo", &[], 5.0)]),
        ("CRLF line endings", "# TYPE foo gauge\r\nfoo 1\r\nbar{a=\"b\"} 2\r\n\r\n", vec![sample("foo", &[], 1.0), sample("bar", &[("a", "b")], 2.0)]),
        ("no final newline", "foo 1\nbar 2", vec![sample("foo", &[], 1.0), sample("bar", &[], 2.0)]),
        (
            "histogram series come through as samples",
            "# TYPE h histogram\nh_bucket{le=\"0.1\"} 1\nh_bucket{le=\"+Inf\"} 3\nh_sum 0.75\nh_count 3\n",
            vec![
                sample("h_bucket", &[("le", "0.1")], 1.0),
                sample("h_bucket", &[("le", "+Inf")], 3.0),
                sample("h_sum", &[], 0.75),
                sample("h_count", &[], 3.0),
            ],
        ),
        (
            "summary series come through as samples",
            "# TYPE s summary\ns{quantile=\"0.5\"} 0.02\ns_sum 31.5\ns_count 1429\n",
            vec![sample("s", &[("quantile", "0.5")], 0.02), sample("s_sum", &[], 31.5), sample("s_count", &[], 1429.0)],
        ),
        (
            "same series under several label sets",
            "foo{engine=\"0\"} 1\nfoo{engine=\"1\"} 2\n",
            vec![sample("foo", &[("engine", "0")], 1.0), sample("foo", &[("engine", "1")], 2.0)],
        ),
    ];
    for (case, text, want) in cases {
        let got = parse_samples(text).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_samples(case, &got, want);
    }
}

#[test]
fn label_lookup() {
    let s = &parse_samples(r#"foo{a="1",b="2"} 3"#).unwrap()[0];
    assert_eq!(s.label("a"), Some("1"));
    assert_eq!(s.label("b"), Some("2"));
    assert_eq!(s.label("c"), None);
}

#[test]
fn label_values_borrow_unless_escaped() {
    let text = "foo{plain=\"x\",escaped=\"a\\nb\"} 1";
    let mut seen = 0;
    for_each_sample(text, |s| {
        assert!(matches!(s.labels[0].1, Cow::Borrowed("x")));
        assert!(matches!(&s.labels[1].1, Cow::Owned(v) if v == "a\nb"));
        seen += 1;
    })
    .unwrap();
    assert_eq!(seen, 1);
}

#[test]
fn syntax_errors_name_the_line_and_the_problem() {
    // (case, body, line, a fragment the reason must contain)
    let cases: &[(&str, &str, usize, &str)] = &[
        ("missing value after labels", "foo{a=\"1\"}", 1, "missing value for metric `foo`"),
        ("missing value after labels and blanks", "foo{a=\"1\"}   ", 1, "missing value"),
        ("missing value, bare name", "foo", 1, "missing value for metric `foo`"),
        ("missing value, bare name and blank", "foo ", 1, "missing value"),
        ("invalid value", "foo abc", 1, "invalid value `abc` for metric `foo`"),
        ("two dots", "foo 1.5.3", 1, "invalid value `1.5.3`"),
        ("hex is not a value", "foo 0x10", 1, "invalid value `0x10`"),
        ("value with comma", "foo 1,5", 1, "invalid value `1,5`"),
        ("invalid timestamp", "foo 1 abc", 1, "invalid timestamp `abc`"),
        ("fractional timestamp", "foo 1 1.5", 1, "invalid timestamp `1.5`"),
        ("timestamp overflows i64", "foo 1 99999999999999999999", 1, "invalid timestamp"),
        ("text after the timestamp", "foo 1 123 extra", 1, "unexpected text `extra` after the sample of `foo`"),
        ("name starts with a digit", "1foo 1", 1, "metric name `1foo` starts with a digit"),
        ("dash in a name", "foo-bar 1", 1, "invalid character `-` in metric name `foo`"),
        ("dot in a name", "foo.bar 1", 1, "invalid character `.` in metric name `foo`"),
        ("missing name", "{a=\"1\"} 1", 1, "expected a metric name, found `{`"),
        ("non-ASCII name", "föo 1", 1, "invalid character `ö` in metric name `f`"),
        ("unterminated label set", "foo{a=\"1\"", 1, "unterminated label set of `foo`"),
        ("unterminated label set after comma", "foo{a=\"1\",", 1, "unterminated label set of `foo`"),
        ("unterminated empty label set", "foo{", 1, "unterminated label set"),
        ("unterminated label value", "foo{a=\"1} 1", 1, "unterminated value of label `a`"),
        ("line ends in a backslash", "foo{a=\"1\\", 1, "line ends in `\\`"),
        ("invalid escape", "foo{a=\"\\x\"} 1", 1, "invalid escape sequence `\\x` in the value of label `a`"),
        ("invalid escape \\t", "foo{a=\"\\t\"} 1", 1, "invalid escape sequence `\\t`"),
        ("unquoted label value", "foo{a=1} 1", 1, "expected `\"` to open the value of label `a`, found `1`"),
        ("single-quoted label value", "foo{a='1'} 1", 1, "expected `\"` to open the value of label `a`"),
        ("missing =", "foo{a \"1\"} 1", 1, "expected `=` after label name `a`, found `\"`"),
        ("colon in a label name", "foo{a:b=\"1\"} 1", 1, "expected `=` after label name `a`, found `:`"),
        ("label name starts with a digit", "foo{1a=\"x\"} 1", 1, "label name `1a` of `foo` starts with a digit"),
        ("missing comma", "foo{a=\"1\" b=\"2\"} 1", 1, "expected `,` or `}` after the value of label `a`, found `b`"),
        ("duplicate label", "foo{a=\"1\",a=\"2\"} 1", 1, "duplicate label `a` on `foo`"),
        ("lone comma", "foo{,} 1", 1, "expected a label name or `}` in the labels of `foo`, found `,`"),
        ("double comma", "foo{a=\"1\",,} 1", 1, "expected a label name or `}`"),
        ("garbage after the value", "foo 1 2 3", 1, "unexpected text `3`"),
        ("a raw HTML error page", "<html><body>502 Bad Gateway</body></html>", 1, "expected a metric name, found `<`"),
        ("JSON", "{\"error\":\"overloaded\"}", 1, "expected a metric name, found `{`"),
        // Line numbers count every line: comments, blanks, CRLF and all.
        (
            "error after comments",
            "# HELP foo x\n# TYPE foo gauge\nfoo 1\nfoo{a=} 2\n",
            4,
            "expected `\"` to open the value of label `a`",
        ),
        ("error after blank lines", "\n\n\nfoo bar\n", 4, "invalid value `bar`"),
        ("error with CRLF endings", "a 1\r\nb 2\r\n\r\nc{x=\"1\"\r\nd 4\r\n", 4, "unterminated label set of `c`"),
        ("error on the last line, no newline", "a 1\nb 2\nc", 3, "missing value for metric `c`"),
        ("first of several errors wins", "ok 1\nbad\nworse{\n", 2, "missing value for metric `bad`"),
        ("lone CR inside a line", "foo 1\r2\n", 1, "invalid value `1\\r2`"),
    ];
    for (case, text, line, fragment) in cases {
        match parse_samples(text) {
            Err(ShimError::Syntax { line: got, reason }) => {
                assert_eq!(got, *line, "{case}: line (reason: {reason})");
                assert!(reason.contains(fragment), "{case}: reason {reason:?} lacks {fragment:?}");
            }
            other => panic!("{case}: expected a syntax error at line {line}, got {other:?}"),
        }
    }
}

#[test]
fn error_message_names_line_and_reason() {
    let err = parse_samples("ok 1\nfoo{a=1} 2\n").unwrap_err();
    assert_eq!(
        err.to_string(),
        "malformed metrics text at line 2: expected `\"` to open the value of label `a`, found `1`"
    );
}

#[test]
fn long_input_is_clipped_in_messages() {
    let junk = "x".repeat(10_000);
    let err = parse_samples(&format!("foo {junk}")).unwrap_err();
    let ShimError::Syntax { reason, .. } = err else { panic!("expected a syntax error") };
    assert!(reason.len() < 200, "reason not clipped: {} bytes", reason.len());
    assert!(reason.contains('…'));
}
