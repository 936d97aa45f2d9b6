package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/idemkit/idem/inbox"
)

var migrateCmd = &command{
	name:    "migrate",
	args:    "[up|down|list] [flags]",
	summary: "Apply (up, the default), revert one step of (down), or list the schema migrations",
	example: `idem migrate up --database-url postgres://postgres@127.0.0.1:5432/app?sslmode=disable
idem migrate list --schema idem --json`,
	setup: func(fs *flag.FlagSet) runFunc {
		return runMigrate
	},
}

type migrationJSON struct {
	Version   int        `json:"version"`
	Name      string     `json:"name"`
	Applied   bool       `json:"applied"`
	AppliedAt *time.Time `json:"applied_at,omitempty"`
}

func runMigrate(ctx context.Context, e *env, args []string) error {
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
	pool, err := e.connect(ctx)
	if err != nil {
		return err
	}
	m, err := inbox.NewMigrator(pool, e.schema)
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
			return e.writeJSON(map[string]any{"schema": e.schema, "applied": nonNil(applied)})
		}
		if len(applied) == 0 {
			fmt.Fprintf(e.stdout, "schema %s is up to date\n", e.schema)
			return nil
		}
		for _, v := range applied {
			fmt.Fprintf(e.stdout, "applied %s to schema %s\n", migrationLabel(v), e.schema)
		}
	case "down":
		v, err := m.Down(ctx)
		if err != nil {
			return err
		}
		if e.json {
			return e.writeJSON(map[string]any{"schema": e.schema, "reverted": v})
		}
		if v == 0 {
			fmt.Fprintf(e.stdout, "schema %s has no migration to revert\n", e.schema)
			return nil
		}
		fmt.Fprintf(e.stdout, "reverted %s in schema %s\n", migrationLabel(v), e.schema)
	case "list":
		list, err := m.List(ctx)
		if err != nil {
			return err
		}
		if e.json {
			out := make([]migrationJSON, 0, len(list))
			for _, s := range list {
				j := migrationJSON{Version: s.Version, Name: s.Name, Applied: s.Applied}
				if s.Applied {
					at := s.AppliedAt
					j.AppliedAt = &at
				}
				out = append(out, j)
			}
			return e.writeJSON(out)
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
	for _, m := range inbox.Migrations() {
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

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
