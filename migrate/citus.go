package migrate

import (
	"context"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/citusmode"
	"github.com/idemkit/idem/internal/pgschema"
)

// citusStep distributes idem's tables on a Citus coordinator, after the numbered
// migrations, in their transaction (Config.Citus). It is not a numbered migration:
// the same numbered files make a plain schema and a Citus one, and this step
// runs after them each time Up runs in Citus mode, distributing what is not yet
// distributed (so it applies once, and covers the tables of later migrations):
//
//   - inbox: distributed by tenant. Every statement idem sends for one key or one
//     tenant names the tenant, so Citus routes it, and its transaction, to the
//     worker that holds the tenant.
//   - effects: distributed by tenant, colocated with inbox, so a tenant's keys
//     and effects share a worker and one transaction holds both. A user's
//     business tables join the same colocation group
//     (create_distributed_table('ledger', 'tenant', colocate_with => 'idem.inbox')).
//   - failure_actions: a reference table (a copy on every node). Its key is an
//     id, not the tenant, and the operator API writes it, rarely.
//   - commit_guard and idem_migrations stay plain tables on the coordinator.
//     commit_guard's deferred trigger then runs on the coordinator, where idem's
//     COMMIT is sent and where idem.commit is set, before the coordinator commits
//     the workers' transactions: a COMMIT a handler sends fails there and rolls
//     back the batch on every node.
//
// A schema migrated without Citus mode on the coordinator (its tables are then
// plain tables of the coordinator) becomes a Citus one by running Up in Citus
// mode: create_distributed_table moves the rows a table holds to the workers,
// under a lock that stops writes to it meanwhile. A schema with a distributed
// inbox gets the step whatever Config.Citus says, so that the tables of a later
// migration are distributed too.
const citusStep = `DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = '/* schema */inbox'::regclass) THEN
        PERFORM create_distributed_table('/* schema */inbox', 'tenant');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = '/* schema */effects'::regclass) THEN
        PERFORM create_distributed_table('/* schema */effects', 'tenant', colocate_with => '/* schema */inbox');
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = '/* schema */failure_actions'::regclass) THEN
        PERFORM create_reference_table('/* schema */failure_actions');
    END IF;
END;
$$`

// distribute runs citusStep in tx when the part is in Citus mode or the
// schema's inbox is distributed already.
func (p *part) distribute(ctx context.Context, tx pgx.Tx) error {
	inbox := pgschema.Table(p.cfg.Schema, "inbox")
	on, err := citusmode.Distributed(ctx, tx, inbox)
	if err != nil {
		return err
	}
	if !p.cfg.Citus && !on {
		return nil
	}
	has, err := citusmode.Installed(ctx, tx)
	if err != nil {
		return err
	}
	if !has {
		return ErrNoCitus
	}
	_, err = tx.Exec(ctx, p.render(citusStep))
	return err
}
