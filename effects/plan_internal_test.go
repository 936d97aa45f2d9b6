package effects

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/idemkit/idem/internal/pgtest"
)

// planBurst is the burst of pending effects the plan tests put in the table.
const planBurst = 100_000

// TestPlansNeedNoStatistics: the claim and both forms of the outcome write (and
// their one-tenant forms) keep to
// their indexes whatever the table's statistics, with a burst of 100,000 pending
// effects in it:
//
//   - fresh: never analyzed (autovacuum is off for the table, so it stays so);
//   - empty: analyzed while empty, then the burst;
//   - small: analyzed with 100 effects, then the burst;
//   - history: analyzed with 100,000 done effects (statistics that say almost
//     nothing is pending), then the burst;
//   - analyzed: analyzed after the burst.
//
// The one-tenant claim is explained for two kinds and for six: the more kinds,
// the more rows the planner expects to claim, and the cheaper reading the
// tenant's rows once looks beside a TID scan per claimed row, where the
// statistics say the tenant (t1) has no effects (small, history).
//
// Each statement is explained as the Dispatcher runs it (its settings, a prepared
// statement, the generic plan), and with a custom plan for the same values. The
// claim reads effects_due_idx in order per kind and updates the rows it locked by
// their ctid; the outcome writes probe the primary key once per outcome. No plan
// may scan the table (a sequential scan, a bitmap scan, an index scan without an
// index condition), sort, hash or merge, or use any other index, and none may hold
// a path the settings disable (which the planner takes only when nothing else is
// possible; its cost gives it away).
//
// Before, the outcome write used effects_due_idx on the fresh table (the index,
// built on the empty table, was taken to hold no rows) and read every pending
// effect of the kind for each outcome.
func TestPlansNeedNoStatistics(t *testing.T) {
	t.Parallel()
	for _, stats := range []string{"fresh", "empty", "small", "history", "analyzed"} {
		t.Run(stats, func(t *testing.T) {
			t.Parallel()
			pool, schema := planTable(t, stats)
			for _, st := range planStatements(t, pool, schema) {
				for _, mode := range []string{"force_generic_plan", "force_custom_plan"} {
					plan := explain(t, pool, st, mode)
					desc := fmt.Sprintf("%s, %s, %s:\n%s", stats, st.name, mode, plan.raw)
					plan.check(t, st, desc)
				}
			}
			if stats == "fresh" {
				var analyzed bool
				require.NoError(t, pool.QueryRow(context.Background(), `SELECT coalesce(last_analyze, last_autoanalyze) IS NOT NULL
					FROM pg_stat_user_tables WHERE relid = 'effects'::regclass`).Scan(&analyzed))
				require.False(t, analyzed, "the fresh table was analyzed during the test")
			}
		})
	}
}

// planTable makes a schema whose effects table has the statistics that stats names
// and planBurst pending effects of two kinds and several tenants.
func planTable(t *testing.T, stats string) (*pgxpool.Pool, string) {
	pool, schema := pgtest.Setup(t, pgtest.Options{MaxConns: 2})
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	insert := func(from, n int, state string) {
		exec(`INSERT INTO effects (tenant, kind, key, payload, fingerprint, state, next_attempt_at,
				source_consumer, source_tenant, source_key)
			SELECT CASE WHEN g % 3 = 0 THEN 't' || (g % 7) ELSE '' END,
				CASE WHEN g % 10 = 0 THEN 'sms' ELSE 'mail' END,
				'k' || g, ''::bytea, sha256(g::text::bytea), $3,
				now() - interval '1 hour' + g * interval '10 microseconds', 'orders', '', 'm' || g
			FROM generate_series($1::int, $1::int + $2::int - 1) g`, from, n, state)
	}
	exec(`ALTER TABLE effects SET (autovacuum_enabled = off)`)
	switch stats {
	case "fresh":
	case "empty":
		exec(`ANALYZE effects`)
	case "small":
		insert(-100, 100, "pending")
		exec(`ANALYZE effects`)
	case "history":
		insert(-planBurst, planBurst, "done")
		exec(`ANALYZE effects`)
	case "analyzed":
		defer exec(`ANALYZE effects`)
	default:
		t.Fatalf("unknown statistics %q", stats)
	}
	insert(0, planBurst, "pending")
	return pool, schema
}

// planStatement is a statement of the Dispatcher's, with its settings, arguments,
// and what its plan must use.
type planStatement struct {
	name, settings, sql string
	args                []any
	indexes             []string // the only indexes the plan may use
	nodes               []string // node types the plan must hold
	conds               []string // text the index conditions must hold
}

func planStatements(t *testing.T, pool *pgxpool.Pool, schema string) []planStatement {
	// Outcomes for 2,000 of the effects (the most one write holds with BatchSize
	// 500), as a claim would have left them.
	rows, err := pool.Query(context.Background(), `SELECT tenant, kind, key FROM effects
		WHERE state = 'pending' ORDER BY tenant, kind, key LIMIT 2000`)
	require.NoError(t, err)
	var tenants, kinds, keys, states []string
	var fences, delays []int64
	var inFlight []bool
	var undo []int32
	var errs []*string
	var tenant, kind, key string
	_, err = pgx.ForEachRow(rows, []any{&tenant, &kind, &key}, func() error {
		tenants, kinds, keys, states = append(tenants, tenant), append(kinds, kind), append(keys, key), append(states, "done")
		fences, delays, inFlight, undo, errs = append(fences, 1), append(delays, 0), append(inFlight, false), append(undo, 0), append(errs, nil)
		return nil
	})
	require.NoError(t, err)
	require.Len(t, keys, 2000)
	recordArgs := []any{tenants, kinds, keys, fences, states, delays, inFlight, undo, errs, errs, errs}
	q := newQueries(schema, 2*DefaultBatchSize, false)
	one := newQueries(schema, 2*DefaultBatchSize, true) // a Dispatcher with a Tenant
	pkey := []string{"((tenant = d.tenant) AND (kind = d.kind) AND (key = d.key))"}
	recordOneArgs := slices.Concat(recordArgs, []any{"t1"})
	return []planStatement{
		{name: "claim one tenant", settings: strings.Join(claimSettings, "; "), sql: one.claim,
			args:    []any{[]string{"mail", "sms"}, []int32{DefaultBatchSize, DefaultBatchSize}, time.Minute, "t1"},
			indexes: []string{"effects_due_idx"}, nodes: []string{"LockRows", "Tid Scan", "Nested Loop"},
			conds: []string{"((kind = w.kind) AND (next_attempt_at <= now()))"}},
		{name: "claim one tenant, six kinds", settings: strings.Join(claimSettings, "; "), sql: one.claim,
			args:    []any{[]string{"mail", "sms", "push", "fax", "webhook", "letter"}, []int32{100, 100, 100, 100, 100, 100}, time.Minute, "t1"},
			indexes: []string{"effects_due_idx"}, nodes: []string{"LockRows", "Tid Scan", "Nested Loop"},
			conds: []string{"((kind = w.kind) AND (next_attempt_at <= now()))"}},
		{name: "record one tenant", settings: strings.Join(recordSettings, "; "), sql: q.recordOne, args: recordOneArgs,
			indexes: []string{"effects_pkey"}, nodes: []string{"Nested Loop"}},
		{name: "recordAgain one tenant", settings: strings.Join(recordSettings, "; "), sql: q.recordAgainOne, args: recordOneArgs,
			indexes: []string{"effects_pkey"}, nodes: []string{"Nested Loop"}},
		{name: "claim", settings: strings.Join(claimSettings, "; "), sql: q.claim,
			args:    []any{[]string{"mail", "sms"}, []int32{DefaultBatchSize, DefaultBatchSize}, time.Minute},
			indexes: []string{"effects_due_idx"}, nodes: []string{"LockRows", "Tid Scan", "Nested Loop"},
			conds: []string{"((kind = w.kind) AND (next_attempt_at <= now()))"}},
		{name: "record", settings: strings.Join(recordSettings, "; "), sql: q.record, args: recordArgs,
			indexes: []string{"effects_pkey"}, nodes: []string{"Nested Loop"}, conds: pkey},
		{name: "recordAgain", settings: strings.Join(recordSettings, "; "), sql: q.recordAgain, args: recordArgs,
			indexes: []string{"effects_pkey"}, nodes: []string{"Nested Loop"}, conds: pkey},
	}
}

// planNode is a node of EXPLAIN (FORMAT JSON).
type planNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	Index     string     `json:"Index Name"`
	IndexCond string     `json:"Index Cond"`
	TotalCost float64    `json:"Total Cost"`
	Plans     []planNode `json:"Plans"`
}

type plan struct {
	root planNode
	raw  string // the same plan as text, for failure messages
}

// explain plans st as the Dispatcher runs it: in a transaction with st's settings,
// as a prepared statement, with plan_cache_mode set to mode afterwards (the
// Dispatcher's settings force the generic plan). Nothing is executed.
func explain(t *testing.T, pool *pgxpool.Pool, st planStatement, mode string) plan {
	t.Helper()
	ctx := context.Background()
	var p plan
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, st.settings); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SET LOCAL plan_cache_mode = `+mode); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `PREPARE planned AS `+st.sql); err != nil {
			return err
		}
		defer func() { _, _ = tx.Exec(ctx, `DEALLOCATE planned`) }()
		// EXPLAIN takes no bind parameters: the values go in as literals.
		params := make([]string, len(st.args))
		for i, a := range st.args {
			params[i] = sqlLiteral(t, a)
		}
		execute := `EXECUTE planned(` + strings.Join(params, ", ") + `)`
		var js []byte
		if err := tx.QueryRow(ctx, `EXPLAIN (FORMAT JSON) `+execute).Scan(&js); err != nil {
			return err
		}
		var out []struct {
			Plan planNode `json:"Plan"`
		}
		if err := json.Unmarshal(js, &out); err != nil {
			return err
		}
		p.root = out[0].Plan
		rows, err := tx.Query(ctx, `EXPLAIN (COSTS OFF) `+execute)
		if err != nil {
			return err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		p.raw = strings.Join(lines, "\n")
		return err
	})
	require.NoError(t, err)
	return p
}

// check fails t unless the plan keeps to st's indexes: see TestPlansNeedNoStatistics.
func (p plan) check(t *testing.T, st planStatement, desc string) {
	t.Helper()
	// A path the settings disable costs 1e10 more; nothing here costs near 1e9.
	require.Less(t, p.root.TotalCost, 1e9, "the plan holds a disabled path: %s", desc)
	seen := map[string]bool{}
	var conds []string
	var walk func(n planNode)
	walk = func(n planNode) {
		seen[n.NodeType] = true
		switch n.NodeType {
		case "Seq Scan", "Bitmap Heap Scan", "Bitmap Index Scan", "Sort", "Incremental Sort",
			"Hash", "Hash Join", "Merge Join":
			t.Errorf("plan has a %s: %s", n.NodeType, desc)
		case "Index Scan", "Index Only Scan":
			if n.Relation == "effects" {
				require.Contains(t, st.indexes, n.Index, "plan uses another index: %s", desc)
				require.NotEmpty(t, n.IndexCond, "index scan without a condition reads the whole index: %s", desc)
				conds = append(conds, n.IndexCond)
			}
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(p.root)
	for _, node := range st.nodes {
		require.True(t, seen[node], "plan has no %s: %s", node, desc)
	}
	for _, c := range st.conds {
		require.Contains(t, conds, c, "plan lacks the index condition %s: %s", c, desc)
	}
}

// sqlLiteral writes v, one of the statements' argument types, as an SQL literal.
func sqlLiteral(t *testing.T, v any) string {
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	array := func(elems []string) string { return "ARRAY[" + strings.Join(elems, ", ") + "]" }
	switch v := v.(type) {
	case []string:
		elems := make([]string, len(v))
		for i, s := range v {
			elems[i] = quote(s)
		}
		return array(elems) + "::text[]"
	case []*string:
		elems := make([]string, len(v))
		for i, s := range v {
			elems[i] = "NULL"
			if s != nil {
				elems[i] = quote(*s)
			}
		}
		return array(elems) + "::text[]"
	case []int32:
		elems := make([]string, len(v))
		for i, n := range v {
			elems[i] = fmt.Sprint(n)
		}
		return array(elems) + "::int[]"
	case []int64:
		elems := make([]string, len(v))
		for i, n := range v {
			elems[i] = fmt.Sprint(n)
		}
		return array(elems) + "::bigint[]"
	case []bool:
		elems := make([]string, len(v))
		for i, b := range v {
			elems[i] = fmt.Sprint(b)
		}
		return array(elems) + "::bool[]"
	case string:
		return quote(v) + "::text"
	case time.Duration:
		return quote(fmt.Sprintf("%d microseconds", v.Microseconds())) + "::interval"
	}
	t.Fatalf("sqlLiteral: unsupported %T", v)
	return ""
}
