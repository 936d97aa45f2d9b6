package main

import (
	"context"
	"flag"
	"fmt"
)

var statsCmd = &command{
	name:    "stats",
	args:    "[flags]",
	summary: "Rows and failures per consumer; pending, due, dead, stuck and oldest pending age per effect kind",
	example: `idem stats
idem stats --schema idem --json | jq '.effects[] | select(.dead > 0)'`,
	setup: func(fs *flag.FlagSet) runFunc { return runStats },
}

func runStats(ctx context.Context, e *env, args []string) error {
	if err := noArgs(args); err != nil {
		return err
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	s, err := a.Stats(ctx)
	if err != nil {
		return err
	}
	if e.json {
		return e.writeJSON(s)
	}
	fmt.Fprintf(e.stdout, "Inbox (schema %s)\n", e.schema)
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
