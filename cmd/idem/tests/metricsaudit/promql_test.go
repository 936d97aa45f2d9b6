package metricsaudit

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// A small PromQL scanner, enough to check a dashboard's queries against a
// registry: it finds the metric names, their label matchers, the labels of
// by/without/on/ignoring/group_left/group_right clauses, and the functions called.
// It does not evaluate or fully validate PromQL (that would take the Prometheus
// module, which is large); it refuses what it does not understand, so a query it
// passes names nothing it has not checked.

type matcher struct{ name, op, value string }

type promSelector struct {
	metric   string
	matchers []matcher
}

type promQuery struct {
	selectors []promSelector
	grouping  []string
	funcs     []string
}

// promFuncs are the functions and aggregations the scanner accepts.
var promFuncs = map[string]bool{}

func init() {
	for _, f := range strings.Fields(`abs absent absent_over_time avg avg_over_time bottomk ceil changes
		clamp clamp_max clamp_min count count_over_time count_values delta deriv floor
		histogram_quantile idelta increase irate label_join label_replace last_over_time
		max max_over_time min min_over_time quantile quantile_over_time rate resets round
		scalar sort sort_desc stddev sum sum_over_time time timestamp topk vector`) {
		promFuncs[f] = true
	}
}

var (
	groupingWords = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}
	keywords      = map[string]bool{"and": true, "or": true, "unless": true, "bool": true, "offset": true, "inf": true, "nan": true}
)

func isIdentStart(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z'
}
func isIdentByte(c byte) bool { return isIdentStart(c) || c >= '0' && c <= '9' }

// peekIdent is the identifier at the start of s, if any.
func peekIdent(s string) string {
	j := 0
	for j < len(s) && isIdentByte(s[j]) {
		j++
	}
	return s[:j]
}

func scanPromQL(expr string) (promQuery, error) {
	var q promQuery
	s := expr
	i := 0
	skipSpace := func() {
		for i < len(s) && strings.ContainsRune(" \t\r\n", rune(s[i])) {
			i++
		}
	}
	ident := func() string {
		start := i
		for i < len(s) && isIdentByte(s[i]) {
			i++
		}
		return s[start:i]
	}
	str := func() (string, error) {
		quote := s[i]
		var b strings.Builder
		for i++; i < len(s); i++ {
			switch {
			case s[i] == '\\' && quote != '`' && i+1 < len(s):
				i++
				b.WriteByte(s[i])
			case s[i] == quote:
				i++
				return b.String(), nil
			default:
				b.WriteByte(s[i])
			}
		}
		return "", fmt.Errorf("unclosed string in %q", expr)
	}
	matchers := func() ([]matcher, error) {
		i++ // {
		var out []matcher
		for {
			skipSpace()
			if i < len(s) && s[i] == '}' {
				i++
				return out, nil
			}
			if i >= len(s) || !isIdentStart(s[i]) {
				return nil, fmt.Errorf("a label name expected at %d in %q", i, expr)
			}
			name := ident()
			skipSpace()
			var op string
			for _, o := range []string{"=~", "!~", "!=", "="} {
				if strings.HasPrefix(s[i:], o) {
					op = o
					break
				}
			}
			if op == "" {
				return nil, fmt.Errorf("a matcher operator expected after %s in %q", name, expr)
			}
			i += len(op)
			skipSpace()
			if i >= len(s) || !strings.ContainsRune("\"'`", rune(s[i])) {
				return nil, fmt.Errorf("a quoted value expected after %s%s in %q", name, op, expr)
			}
			v, err := str()
			if err != nil {
				return nil, err
			}
			out = append(out, matcher{name, op, v})
			skipSpace()
			if i < len(s) && s[i] == ',' {
				i++
			}
		}
	}
	for {
		skipSpace()
		if i >= len(s) {
			return q, nil
		}
		c := s[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			if _, err := str(); err != nil {
				return q, err
			}
		case c == '[': // a range or subquery: durations and $__rate_interval
			j := strings.IndexByte(s[i:], ']')
			if j < 0 {
				return q, fmt.Errorf("unclosed [ in %q", expr)
			}
			i += j + 1
		case c == '{':
			return q, fmt.Errorf("a selector without a metric name in %q", expr)
		case c >= '0' && c <= '9' || c == '.':
			for i < len(s) && (isIdentByte(s[i]) || s[i] == '.') {
				i++
			}
		case isIdentStart(c):
			word := ident()
			skipSpace()
			next := byte(0)
			if i < len(s) {
				next = s[i]
			}
			switch {
			case groupingWords[word]:
				if next != '(' {
					if word == "group_left" || word == "group_right" {
						continue
					}
					return q, fmt.Errorf("%s without ( in %q", word, expr)
				}
				j := strings.IndexByte(s[i:], ')')
				if j < 0 {
					return q, fmt.Errorf("unclosed %s( in %q", word, expr)
				}
				for _, l := range strings.Split(s[i+1:i+j], ",") {
					if l = strings.TrimSpace(l); l != "" {
						q.grouping = append(q.grouping, l)
					}
				}
				i += j + 1
			case next == '(' || promFuncs[word] && (peekIdent(s[i:]) == "by" || peekIdent(s[i:]) == "without"):
				// A call, or an aggregation whose by/without clause comes first.
				q.funcs = append(q.funcs, word)
			case keywords[word]:
			default:
				sel := promSelector{metric: word}
				if next == '{' {
					ms, err := matchers()
					if err != nil {
						return q, err
					}
					sel.matchers = ms
				}
				q.selectors = append(q.selectors, sel)
			}
		default:
			if !strings.ContainsRune("()+-*/%^,<>=!", rune(c)) {
				return q, fmt.Errorf("unexpected %q at %d in %q", c, i, expr)
			}
			i++
		}
	}
}

func TestScanPromQL(t *testing.T) {
	t.Parallel()
	q, err := scanPromQL(`histogram_quantile(0.99, sum by (consumer, le) (rate(idem_inbox_lock_wait_seconds_bucket{consumer=~"$consumer", x!="a\"b"}[$__rate_interval])))
		/ on (consumer) group_left sum without (code) (idem_x_total offset 5m) > bool 0`)
	require.NoError(t, err)
	require.Equal(t, []promSelector{
		{metric: "idem_inbox_lock_wait_seconds_bucket", matchers: []matcher{{"consumer", "=~", "$consumer"}, {"x", "!=", `a"b`}}},
		{metric: "idem_x_total"},
	}, q.selectors)
	require.Equal(t, []string{"consumer", "le", "consumer", "code"}, q.grouping)
	require.Equal(t, []string{"histogram_quantile", "sum", "rate", "sum"}, q.funcs)

	q, err = scanPromQL(`time() - max by (schema) (idem_janitor_last_success_timestamp_seconds)`)
	require.NoError(t, err)
	require.Equal(t, []string{"time", "max"}, q.funcs)
	require.Equal(t, []promSelector{{metric: "idem_janitor_last_success_timestamp_seconds"}}, q.selectors)

	for _, bad := range []string{`{consumer="a"}`, `rate(x{a="b"[5m])`, `x{a~"b"}`, `sum by consumer (x)`, `x{a="b}`, `x # y`} {
		_, err := scanPromQL(bad)
		require.Error(t, err, bad)
	}
}
