package main

import (
	"context"
	"fmt"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
)

var statsCmd = &command{
	name:    "stats",
	args:    "[flags]",
	summary: "Rows and failures per consumer; pending, due, dead, stuck and oldest pending age per effect kind",
	example: `idem stats
idem stats --shard s1=postgres://db1/app --shard s2=postgres://db2/app,schema=idem
idem stats --schema idem --json | jq '.effects[] | select(.dead > 0)'`,
	setup: func(fs *pflag.FlagSet) runFunc { return runStats },
}

func runStats(ctx context.Context, e *env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	// Over a shard map, a shard that does not answer is named, with the figures
	// of those that did, and the command fails (exit 3, shard_unavailable).
	s, err := a.Stats(ctx)
	if s == nil {
		return err
	}
	if e.json {
		if werr := e.writeJSON(s); werr != nil {
			return werr
		}
		return err
	}
	if len(s.Shards) > 0 {
		tw := e.table("SHARD", "SCHEMA", "STATUS", "INBOX ROWS", "FAILED", "PENDING EFFECTS", "DEAD")
		for _, sh := range s.Shards {
			status := "up"
			if !sh.Up() {
				status = "DOWN: " + clip(sh.Error, 60)
			}
			var rows, failed, pending, dead int64
			for _, c := range sh.Consumers {
				rows, failed = rows+c.Rows, failed+c.Failed
			}
			for _, k := range sh.Effects {
				pending, dead = pending+k.Pending, dead+k.Dead
			}
			row(tw, printable(sh.Shard), sh.Schema, status, rows, failed, pending, dead)
		}
		if werr := tw.Flush(); werr != nil {
			return werr
		}
		fmt.Fprintln(e.stdout)
	}
	defer func() {
		if err != nil {
			fmt.Fprintln(e.stdout, "\n(the shards marked DOWN are not counted)")
		}
	}()
	if werr := statsTables(e, s); werr != nil {
		return werr
	}
	return err
}

func statsTables(e *env, s *admin.Stats) error {
	fmt.Fprintf(e.stdout, "Inbox (%s)\n", e.where())
	if len(s.Consumers) == 0 {
		fmt.Fprintln(e.stdout, "  no rows")
	} else {
		tw := e.table("CONSUMER", "ROWS", "COMPLETED", "FAILED", "PROCESSING", "EXPIRED")
		for _, c := range s.Consumers {
			row(tw, printable(c.Consumer), c.Rows, c.Completed, c.Failed, c.Processing, c.Expired)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	fmt.Fprintln(e.stdout, "\nEffects")
	if len(s.Effects) == 0 {
		fmt.Fprintln(e.stdout, "  no rows")
		return nil
	}
	tw := e.table("KIND", "PENDING", "DUE", "DEAD", "DONE", "OLDEST PENDING", "STUCK")
	for _, k := range s.Effects {
		oldest := "-"
		if k.Pending > 0 {
			oldest = age(k.OldestPendingAge())
		}
		row(tw, k.Kind, k.Pending, k.Due, k.Dead, k.Done, oldest, k.Stuck)
	}
	return tw.Flush()
}
