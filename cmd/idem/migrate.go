package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/migrate"
)

var migrateCmd = &command{
	name:    "migrate",
	args:    "[up|down|list] [--yes] [--citus] [flags]",
	summary: "Apply (up, the default), revert one step of (down), or list the schema migrations",
	example: `idem migrate up --database-url postgres://postgres@127.0.0.1:5432/app?sslmode=disable
idem migrate list --schema idem --json
idem migrate down --schema idem            # shows what it would drop, asks on a terminal
idem migrate down --schema idem --yes      # no question: for scripts
idem migrate up --citus --database-url postgres://postgres@coordinator:5432/app

up --citus, on a Citus coordinator, also distributes the tables by tenant
(inbox and effects colocated); see docs/citus.md.

list only reads: it creates nothing and works for a read-only role.
down drops the newest migration's tables and every row in them. It first shows
them with their row counts, then asks you to type the schema name (on a terminal),
or needs --yes; without either it changes nothing and exits 2. With --json it
never asks: without --yes the error (code confirmation_required) holds the plan.`,
	words: []string{"up", "down", "list"},
	setup: func(fs *pflag.FlagSet) runFunc {
		var o migrateOpts
		fs.BoolVar(&o.yes, "yes", false, "down: revert without asking (it drops the tables shown and their rows)")
		fs.BoolVar(&o.citus, "citus", false, "up: the database is a Citus coordinator; distribute the tables by tenant")
		return runWith(&o, runMigrate)
	},
}

type migrationJSON struct {
	Version   int        `json:"version"`
	Name      string     `json:"name"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at,omitempty"`
}

func migrationsJSON(list []migrate.Migration) []migrationJSON {
	out := make([]migrationJSON, 0, len(list))
	for _, s := range list {
		j := migrationJSON{Version: s.Version, Name: s.Name, Applied: s.Applied}
		if s.Applied {
			at := s.AppliedAt
			j.AppliedAt = &at
		}
		out = append(out, j)
	}
	return out
}

// migrateOpts are migrate's own flags.
type migrateOpts struct {
	yes, citus bool
}

func runMigrate(ctx context.Context, e *env, args []string, o migrateOpts) error {
	yes := o.yes
	action := "up"
	switch len(args) {
	case 0:
	case 1:
		action = args[0]
	default:
		return usagef("takes one action (up, down or list), got %q", args)
	}
	if action != "up" && action != "down" && action != "list" {
		return usagef("unknown action %q: use up, down or list", action)
	}
	if yes && action != "down" {
		return usagef("--yes is for migrate down only")
	}
	if o.citus && action != "up" {
		return usagef("--citus is for migrate up only")
	}
	if o.citus && e.shardsGiven() {
		return usagef("--citus is for one Citus coordinator, not a shard map")
	}
	if e.shardsGiven() {
		return migrateShards(ctx, e, action)
	}
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: e.schema, Citus: o.citus})
	if err != nil {
		return err
	}
	switch action {
	case "up":
		applied, err := m.Up(ctx)
		if err != nil {
			return err
		}
		if e.json {
			if applied == nil {
				applied = []int{} // JSON [] rather than null
			}
			return e.writeJSON(map[string]any{"schema": e.schema, "applied": applied})
		}
		if len(applied) == 0 {
			fmt.Fprintf(e.stdout, "schema %s is up to date\n", e.schema)
			return nil
		}
		for _, v := range applied {
			fmt.Fprintf(e.stdout, "applied %s to schema %s\n", migrationLabel(v), e.schema)
		}
	case "down":
		return migrateDown(ctx, e, m, yes)
	case "list":
		list, err := m.List(ctx)
		if err != nil {
			return err
		}
		if e.json {
			return e.writeJSON(migrationsJSON(list))
		}
		tw := e.table("VERSION", "NAME", "APPLIED", "APPLIED AT")
		for _, s := range list {
			at := "-"
			if s.Applied {
				at = ts(&s.AppliedAt)
			}
			row(tw, fmt.Sprintf("%03d", s.Version), s.Name, yesNo(s.Applied), at)
		}
		return tw.Flush()
	}
	return nil
}

func migrationLabel(v int) string {
	for _, m := range migrate.Migrations() {
		if m.Version == v {
			return fmt.Sprintf("%03d_%s", m.Version, m.Name)
		}
	}
	return fmt.Sprintf("%03d", v)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

type droppedJSON struct {
	Table string `json:"table"`
	Rows  int64  `json:"rows"`
}

type droppedColumnJSON struct {
	Table  string `json:"table"`
	Column string `json:"column"`
	Rows   int64  `json:"rows_with_value"`
}

// migrateDown shows what reverting the newest migration drops, gets a yes (--yes,
// or the schema name typed on a terminal), then reverts exactly that step.
func migrateDown(ctx context.Context, e *env, m *migrate.Migrator, yes bool) error {
	plan, err := m.PlanDown(ctx)
	if err != nil {
		return err
	}
	if plan.Version == 0 {
		if e.json {
			return e.writeJSON(revertedJSON(e.schema, migrate.DownPlan{}))
		}
		fmt.Fprintf(e.stdout, "schema %s has no migration to revert\n", e.schema)
		return nil
	}
	label := migrationLabel(plan.Version)
	fmt.Fprintf(e.notes(), "idem migrate down: reverting %s in schema %s: %s\n", label, e.schema, describeDrops(plan))
	what := "what is listed above"
	if e.json {
		what = "what the plan lists"
	}
	if err := e.confirmed(question{yes: yes,
		refused: confirm(downJSON(e.schema, plan, label), "nothing was changed: migrate down drops %s, with its data; to do it, run it again with --yes", what),
		want:    e.schema, shown: "the schema name (" + e.schema + ")", action: "revert"}); err != nil {
		return err
	}
	done, err := m.Revert(ctx, plan.Version)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(revertedJSON(e.schema, done))
	}
	fmt.Fprintf(e.stdout, "reverted %s in schema %s: %s\n", label, e.schema, strings.TrimPrefix(describeDrops(done), "dropping "))
	return nil
}

// dropsJSON is what a step of migrate down drops: its tables, and its columns of
// the tables it keeps.
type dropsJSON struct {
	Dropped        []droppedJSON       `json:"dropped"`
	DroppedColumns []droppedColumnJSON `json:"dropped_columns"`
}

func drops(plan migrate.DownPlan) dropsJSON {
	out := dropsJSON{Dropped: make([]droppedJSON, 0, len(plan.Tables)), DroppedColumns: make([]droppedColumnJSON, 0, len(plan.Columns))}
	for _, t := range plan.Tables {
		out.Dropped = append(out.Dropped, droppedJSON{t.Table, t.Rows})
	}
	for _, c := range plan.Columns {
		out.DroppedColumns = append(out.DroppedColumns, droppedColumnJSON{c.Table, c.Column, c.Rows})
	}
	return out
}

// downPlanJSON is what migrate down would drop: the plan of its
// confirmation_required error.
type downPlanJSON struct {
	Schema    string `json:"schema"`
	Version   int    `json:"version"`
	Migration string `json:"migration"`
	dropsJSON
}

func downJSON(schema string, plan migrate.DownPlan, label string) downPlanJSON {
	return downPlanJSON{Schema: schema, Version: plan.Version, Migration: label, dropsJSON: drops(plan)}
}

// revertedJSON is the --json output of migrate down: the version it reverted (0:
// none, there was nothing to revert) and what that dropped.
func revertedJSON(schema string, done migrate.DownPlan) map[string]any {
	d := drops(done)
	return map[string]any{"schema": schema, "reverted": done.Version, "dropped": d.Dropped, "dropped_columns": d.DroppedColumns}
}

// describeDrops says which tables and columns go, and how much data each holds.
func describeDrops(plan migrate.DownPlan) string {
	if len(plan.Tables) == 0 && len(plan.Columns) == 0 {
		return "it drops no tables and no columns"
	}
	var parts []string
	for _, t := range plan.Tables {
		parts = append(parts, fmt.Sprintf("table %s (%d rows)", t.Table, t.Rows))
	}
	for _, c := range plan.Columns {
		parts = append(parts, fmt.Sprintf("column %s.%s (%d rows hold a value)", c.Table, c.Column, c.Rows))
	}
	return "dropping " + strings.Join(parts, ", ")
}

// migrateShards runs migrate up or list on every shard of the map. Up applies to
// each shard in its own transaction, goes on past a shard that fails, and names
// every one that failed (run it again once they are back: a current shard applies
// nothing). Down reverts one shard at a time: give that shard alone.
func migrateShards(ctx context.Context, e *env, action string) error {
	if action == "down" {
		return usagef("migrate down reverts one database: give the shard alone (--shard NAME=URL[,schema=S], or --database-url and --schema)")
	}
	sm, err := e.shardMap(ctx)
	if err != nil {
		return err
	}
	m, err := migrate.New(migrate.Config{Shards: sm})
	if err != nil {
		return err
	}
	if action == "up" {
		applied, err := m.Up(ctx)
		if err != nil {
			return err
		}
		if e.json {
			if applied == nil {
				applied = []int{}
			}
			return e.writeJSON(map[string]any{"shards": sm.Names(), "applied": applied})
		}
		if len(applied) == 0 {
			fmt.Fprintf(e.stdout, "%s are up to date\n", e.where())
		}
		for _, v := range applied {
			fmt.Fprintf(e.stdout, "applied %s to %s (where it was missing)\n", migrationLabel(v), e.where())
		}
		return nil
	}
	type shardList struct {
		Shard      string          `json:"shard"`
		Schema     string          `json:"schema"`
		Migrations []migrationJSON `json:"migrations"`
	}
	list, err := m.List(ctx)
	if err != nil {
		return err
	}
	var out []shardList
	for _, s := range sm.Shards {
		mine := slices.DeleteFunc(slices.Clone(list), func(mig migrate.Migration) bool { return mig.Shard != s.Name })
		out = append(out, shardList{Shard: s.Name, Schema: s.SchemaName(), Migrations: migrationsJSON(mine)})
	}
	if e.json {
		return e.writeJSON(out)
	}
	tw := e.table("SHARD", "VERSION", "NAME", "APPLIED", "APPLIED AT")
	for _, l := range out {
		for _, j := range l.Migrations {
			row(tw, l.Shard, fmt.Sprintf("%03d", j.Version), j.Name, yesNo(j.Applied), ts(j.AppliedAt))
		}
	}
	return tw.Flush()
}
