// Package sqlaudit reads an SQL statement the way a router by tenant would: does
// it name one tenant (the shard column), so that a distributed Postgres could send
// it, and its transaction, to one node? The statement audit (its tests) holds every
// statement idem sends to this, and to a short allow-list of statements that
// cannot name one tenant, each with its reason. CitusRefusals adds Citus's own
// rules (what Citus refuses even in a statement that names one tenant), so that
// the audit, which runs on plain Postgres, fails on a statement Citus would
// refuse. It imports the standard library only.
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

// notImmutable matches a call of a function that is not IMMUTABLE among those
// idem's statements use: the clock, settings and random values.
var notImmutable = regexp.MustCompile(`(?i)\b(now|clock_timestamp|statement_timestamp|transaction_timestamp|current_setting|set_config|random|gen_random_uuid|nextval)\(|\bcurrent_timestamp\b`)

// Citus's rules: what Citus refuses in a statement on distributed tables, each
// with the text of its error. CitusRefusals reads them from the statement's text.
var (
	// pgNotify is a call of pg_notify; castAfter is what follows a cast.
	pgNotify  = regexp.MustCompile(`(?i)\bpg_notify\(`)
	castAfter = regexp.MustCompile(`^\s*::`)
	// onConflictWhere is the WHERE of ON CONFLICT … DO UPDATE, up to RETURNING.
	onConflictWhere = regexp.MustCompile(`(?i)\bON CONFLICT\b.*?\bDO UPDATE\b.*?\bWHERE\b(.*?)(\bRETURNING\b|$)`)
	// forUpdate is a row lock clause.
	forUpdate = regexp.MustCompile(`(?i)\bFOR (UPDATE|SHARE|NO KEY UPDATE|KEY SHARE)\b`)
	// writeHead starts the part of a statement that writes a table.
	writeHead = regexp.MustCompile(`(?i)\b(INSERT INTO|UPDATE|DELETE FROM)\b`)
	// lockOrConflict ends in the word before an UPDATE that is not a write: FOR
	// UPDATE, NO KEY UPDATE, ON CONFLICT … DO UPDATE.
	lockOrConflict = regexp.MustCompile(`(?i)\b(FOR|KEY|DO) $`)
	// returning starts a RETURNING clause.
	returning = regexp.MustCompile(`(?i)\bRETURNING\b`)
	// caseOrCoalesce starts a CASE expression or a COALESCE call.
	caseOrCoalesce = regexp.MustCompile(`(?i)\bCASE\b|\bcoalesce\(`)
	// withRecursive starts a recursive CTE.
	withRecursive = regexp.MustCompile(`(?i)\bWITH RECURSIVE\b`)
	// genericPlans asks Postgres for generic plans.
	genericPlans = regexp.MustCompile(`(?i)\bplan_cache_mode\s*(=|TO)\s*'?force_generic_plan`)
)

// CitusRefusals returns, for a statement idem sends on a table distributed by
// Citus, each rule of Citus's that it breaks, as the error Citus answers with
// (none: Citus takes it). It reads the text, as Routable does, and knows the
// refusals idem's statements met on Citus 13.2:
//
//   - pg_notify inside a CTE or subquery without a cast: its void result cannot
//     be carried between nodes ("column "pg_notify" has pseudo-type void").
//   - A function that is not IMMUTABLE (now(), current_setting…) in the WHERE of
//     ON CONFLICT … DO UPDATE, in a RETURNING clause, or inside CASE or COALESCE
//     at the level of the statement that writes a table (its SET, its WHERE, an
//     INSERT's select list; not in a subquery, which Citus plans apart).
//   - FOR UPDATE or FOR SHARE in a statement that does not name one tenant: row
//     locks across shards.
//   - A recursive CTE in a statement that does not name one tenant (a loose
//     index scan across shards).
//   - plan_cache_mode = force_generic_plan: Citus cannot plan a parameterized
//     statement on distributed tables without its parameters.
//
// It does not know Citus's refusal of a join it cannot push down to the shards
// ("complex joins are only supported when all distributed tables are co-located
// and joined on their distribution columns"), which depends on the plan: the
// tests on a Citus cluster find those.
func CitusRefusals(sql string) []string {
	s := Normalize(sql)
	var out []string
	for _, at := range pgNotify.FindAllStringIndex(s, -1) {
		end := closing(s, at[1])
		if depth(s, at[0]) > 0 && (end == len(s) || !castAfter.MatchString(s[end+1:])) {
			out = append(out, `column "pg_notify" has pseudo-type void`)
			break
		}
	}
	if m := onConflictWhere.FindStringSubmatch(s); m != nil && notImmutable.MatchString(m[1]) {
		out = append(out, "functions used in the WHERE clause of the ON CONFLICT clause of INSERTs on distributed tables must be marked IMMUTABLE")
	}
	inCase, inReturning := false, false
	for _, w := range writeHead.FindAllStringIndex(s, -1) {
		if lockOrConflict.MatchString(s[:w[0]]) {
			continue // FOR UPDATE, DO UPDATE: not a write of its own
		}
		write := s[w[0]:closing(s, w[0])]
		body := write
		if r := returning.FindStringIndex(write); r != nil {
			body = write[:r[0]]
			inReturning = inReturning || notImmutable.MatchString(write[r[1]:])
		}
		for _, c := range caseOrCoalesce.FindAllStringIndex(body, -1) {
			if depth(body, c[0]) > 0 {
				continue // in a subquery (OFFSET 0), which Citus plans apart
			}
			var inner string
			if strings.HasSuffix(body[c[0]:c[1]], "(") {
				inner = body[c[1]:closing(body, c[1])]
			} else {
				inner = body[c[1]:caseEnd(body, c[1])]
			}
			inCase = inCase || notImmutable.MatchString(inner)
		}
	}
	if inReturning {
		out = append(out, "non-IMMUTABLE functions are not allowed in the RETURNING clause")
	}
	if inCase {
		out = append(out, "non-IMMUTABLE functions are not allowed in CASE or COALESCE statements")
	}
	if forUpdate.MatchString(s) && !Routable(s) {
		out = append(out, "could not run distributed query with FOR UPDATE/SHARE commands")
	}
	if withRecursive.MatchString(s) && !Routable(s) {
		out = append(out, "recursive CTEs are only supported when they contain a filter on the distribution column")
	}
	if genericPlans.MatchString(s) {
		out = append(out, "could not create distributed plan: generic plans of parameterized statements")
	}
	return out
}

// depth is the depth of parentheses at i in s.
func depth(s string, i int) int {
	d := 0
	for j := range i {
		switch s[j] {
		case '(':
			d++
		case ')':
			d--
		}
	}
	return d
}

// closing is the index in s of the parenthesis that closes the one open at i
// (the depth at i, from i on), or len(s).
func closing(s string, i int) int {
	d := 0
	for j := i; j < len(s); j++ {
		switch s[j] {
		case '(':
			d++
		case ')':
			if d == 0 {
				return j
			}
			d--
		}
	}
	return len(s)
}

// caseEnd is the index in s of the END that closes a CASE whose body starts at
// i, counting nested CASEs, or len(s).
func caseEnd(s string, i int) int {
	d := 0
	for j := i; j < len(s); j++ {
		if !wordAt(s, j) {
			continue
		}
		switch {
		case hasWordAt(s, j, "CASE"):
			d++
		case hasWordAt(s, j, "END"):
			if d == 0 {
				return j
			}
			d--
		}
	}
	return len(s)
}

// wordAt reports whether a word starts at j in s.
func wordAt(s string, j int) bool {
	return j == 0 || !isWordByte(s[j-1])
}

// hasWordAt reports whether the word w (upper case) is at j in s.
func hasWordAt(s string, j int, w string) bool {
	return len(s) >= j+len(w) && strings.EqualFold(s[j:j+len(w)], w) && (len(s) == j+len(w) || !isWordByte(s[j+len(w)]))
}

func isWordByte(b byte) bool {
	return b == '_' || b >= '0' && b <= '9' || b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z'
}
