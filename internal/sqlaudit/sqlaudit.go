// Package sqlaudit reads an SQL statement the way a router by tenant would: does
// it name one tenant (the shard column), so that a distributed Postgres could send
// it, and its transaction, to one node? The statement audit (its tests) holds every
// statement idem sends to this, and to a short allow-list of statements that
// cannot name one tenant, each with its reason. It imports the standard library
// only.
package sqlaudit

import (
	"reflect"
	"regexp"
	"strings"
)

// The shard column.
const column = "tenant"

var (
	// space collapses runs of white space.
	space = regexp.MustCompile(`\s+`)
	// tenantEquals is a conjunct that equals the tenant column (bare or qualified)
	// to one bind parameter, after WHERE, AND or ON: never under OR.
	tenantEquals = regexp.MustCompile(`(?i)\b(WHERE|AND|ON) (\w+\.)?` + column + ` = \$\d+\b`)
	// insertInto is the head of an INSERT with a column list, up to its VALUES or
	// SELECT.
	insertInto = regexp.MustCompile(`(?i)\bINSERT INTO [^ (]+(?: AS \w+)? ?\(([^)]*)\) ?(VALUES ?\(|SELECT )`)
	// param is one bind parameter, perhaps cast.
	param = regexp.MustCompile(`^\$\d+(::\w+)?$`)
)

// Normalize collapses sql's white space, so that statements compare and match
// whatever their indentation.
func Normalize(sql string) string {
	return strings.TrimSpace(space.ReplaceAllString(sql, " "))
}

// Routable reports whether sql names one tenant: it has a conjunct
// "tenant = $n" (or "alias.tenant = $n") after WHERE, AND or ON, or it inserts
// rows whose tenant column is one bind parameter ($n in VALUES, or in the select
// list of INSERT … SELECT). It reads the text, not a parse tree: an equality
// nested in an OR below an AND would pass, and idem writes none.
func Routable(sql string) bool {
	s := Normalize(sql)
	if tenantEquals.MatchString(s) {
		return true
	}
	for _, m := range insertInto.FindAllStringSubmatchIndex(s, -1) {
		cols := strings.Split(s[m[2]:m[3]], ",")
		at := -1
		for i, c := range cols {
			if strings.EqualFold(strings.TrimSpace(c), column) {
				at = i
			}
		}
		if at < 0 {
			continue
		}
		items := topLevelItems(s[m[5]:])
		if at < len(items) && param.MatchString(items[at]) {
			return true
		}
	}
	return false
}

// topLevelItems splits the start of s, a VALUES row or a select list, into its
// comma-separated items, up to the closing parenthesis of the row or the FROM of
// the list.
func topLevelItems(s string) []string {
	var items []string
	depth, start := 0, 0
	for i := range len(s) {
		switch s[i] {
		case '(':
			depth++
		case ')':
			if depth == 0 {
				return append(items, strings.TrimSpace(s[start:i]))
			}
			depth--
		case ',':
			if depth == 0 {
				items = append(items, strings.TrimSpace(s[start:i]))
				start = i + 1
			}
		case ' ':
			if depth == 0 && len(s) >= i+6 && strings.EqualFold(s[i:i+6], " FROM ") {
				return append(items, strings.TrimSpace(s[start:i]))
			}
		}
	}
	return append(items, strings.TrimSpace(s[start:]))
}

// control matches transaction control and settings: statements that touch no
// table and go wherever their transaction goes.
var control = regexp.MustCompile(`(?i)^(BEGIN|START TRANSACTION|COMMIT|ROLLBACK|SAVEPOINT \w+|RELEASE( SAVEPOINT)? \w+|ROLLBACK TO( SAVEPOINT)? \w+|SET LOCAL [^;]+|SET TRANSACTION [^;]+)( ISOLATION LEVEL [A-Z ]+)?$`)

// Control reports whether sql is transaction control (BEGIN, COMMIT, ROLLBACK,
// SAVEPOINT, RELEASE, ROLLBACK TO) or a transaction's setting (SET LOCAL, SET
// TRANSACTION): no table, and no tenant to name.
func Control(sql string) bool {
	return control.MatchString(Normalize(sql))
}

// Allowed is one entry of an allow-list: the statements that Match matches may
// leave the tenant out, for the reason Why.
type Allowed struct {
	Why   string
	Match *regexp.Regexp // on the normalized statement
}

// Check returns, for each statement of stmts that is neither Routable, Control
// nor matched by an entry of allow, a line that says so, and each entry of allow
// that matched nothing is unused (so the list stays short and true). Statements
// are normalized first.
func Check(stmts []string, allow []Allowed) (flagged []string, unused []string) {
	used := make([]bool, len(allow))
	seen := map[string]bool{}
	for _, sql := range stmts {
		s := Normalize(sql)
		if seen[s] {
			continue
		}
		seen[s] = true
		if Control(s) {
			continue
		}
		ok := false
		for i, a := range allow {
			if a.Match.MatchString(s) {
				used[i], ok = true, true
			}
		}
		if !ok && !Routable(s) {
			flagged = append(flagged, s)
		}
	}
	for i, a := range allow {
		if !used[i] {
			unused = append(unused, a.Why)
		}
	}
	return flagged, unused
}

// CheckFields is the static half of the audit, for a struct of statements such
// as inboxdb.Queries: it returns a line for each string field of v (a struct)
// whose statement does not name one tenant and whose name allow does not list
// (name: why), and for each name of allow that is not such a field, or whose
// statement names one tenant after all (so the list stays short and true). A
// field added later is checked without anyone listing it.
func CheckFields(v any, allow map[string]string) []string {
	var bad []string
	rv := reflect.ValueOf(v)
	listed := map[string]bool{}
	for i := range rv.NumField() {
		f := rv.Type().Field(i)
		if f.Type.Kind() != reflect.String {
			continue
		}
		sql := rv.Field(i).String()
		_, ok := allow[f.Name]
		listed[f.Name] = ok
		switch {
		case ok && (Routable(sql) || Control(sql)):
			bad = append(bad, f.Name+" names one tenant: take it off the allow-list")
		case !ok && !Routable(sql) && !Control(sql):
			bad = append(bad, f.Name+" names no tenant: "+Normalize(sql))
		}
	}
	for name := range allow {
		if !listed[name] {
			bad = append(bad, name+" is on the allow-list but is no statement field")
		}
	}
	return bad
}
