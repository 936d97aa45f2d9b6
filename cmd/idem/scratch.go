package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/cmd/idem/internal/scratch"
	"github.com/idemkit/idem/migrate"
)

// scratchUser is a command that works in a scratch schema: the flag that names
// the schema, the command's name, and its default schema.
type scratchUser struct {
	flag, tool, defaultSchema string
}

var (
	demoScratch  = scratchUser{flag: "--schema", tool: "idem demo", defaultSchema: demoSchema}
	benchScratch = scratchUser{flag: "--bench-schema", tool: "idem bench", defaultSchema: benchSchema}
)

// claimScratch claims schema for u, made afresh, and migrates it. It refuses a
// schema that idem demo or idem bench did not make, and one that another run is
// using (scratchError says what to do). The caller releases the claim.
func claimScratch(ctx context.Context, e *env, pool *pgxpool.Pool, schema string, u scratchUser) (*scratch.Schema, error) {
	claimed, err := scratch.Claim(ctx, e.databaseURL, schema, u.tool)
	if err != nil {
		return nil, scratchError(u.flag, u.tool, u.defaultSchema, err)
	}
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: schema})
	if err == nil {
		_, err = m.Up(ctx)
	}
	if err != nil {
		claimed.Release()
		return nil, fmt.Errorf("migrate schema %s: %w", schema, err)
	}
	return claimed, nil
}

// scratchError turns a refusal of package scratch into what the user reads: a
// schema that is not the tool's own is bad usage (exit 2), one that another run
// holds is a failure (exit 1); both say what to do next.
func scratchError(flagName, tool, defaultSchema string, err error) error {
	var re *scratch.RefusedError
	switch {
	case errors.As(err, &re):
		var b strings.Builder
		fmt.Fprintf(&b, "%s %s: %v.\n%s drops and makes again the schema it works in, so it only uses a schema that idem demo or idem bench created and marked; it never drops or empties yours.\n",
			flagName, re.Schema, err, tool)
		fmt.Fprintf(&b, "Name a schema that does not exist yet (%s creates and marks it): %s %s_2", tool, flagName, defaultSchema)
		if strings.Contains(re.Reason, "no idem scratch marker") {
			fmt.Fprintf(&b, ".\nIf %s is a leftover of an older %s that you no longer need, drop it yourself: DROP SCHEMA %s CASCADE", re.Schema, tool, re.Schema)
		}
		return usagef("%s", b.String())
	case errors.Is(err, scratch.ErrInUse):
		return fmt.Errorf("%w: another idem demo or idem bench run is using it right now.\n"+
			"Wait for that run to end, or give this one a schema of its own: %s %s_2", err, flagName, defaultSchema)
	}
	return err
}
