package admin_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/pgtest"
	"github.com/idemkit/idem/shard"
)

// TestMain runs a child role of the crash tests in a child process, and otherwise
// the tests.
func TestMain(m *testing.M) {
	childproc.Main(map[string]childproc.Role{roleMove: moveAndDie})
	os.Exit(m.Run())
}

// roleMove moves a tenant (params tenant, from, to) between the shard clusters'
// copies of schema, and SIGKILLs itself right after the step die_at has
// committed.
const roleMove = "move"

func moveAndDie(ctx context.Context, p childproc.Params) error {
	m := &shard.Map{}
	for i, url := range strings.Split(os.Getenv(pgtest.ShardURLsVar), ",") {
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			return err
		}
		defer pool.Close()
		m.Shards = append(m.Shards, shard.Shard{Name: fmt.Sprintf("s%d", i+1), Pool: pool, Schema: p["schema"]})
	}
	a, err := admin.New(admin.Config{Shards: m})
	if err != nil {
		return err
	}
	admin.SetMoveStep(func(step string) {
		if step == p["die_at"] {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {}
		}
	})
	_, err = a.MoveTenant(ctx, admin.MoveTenant{Tenant: p["tenant"], From: p["from"], To: p["to"]})
	if err != nil {
		return err
	}
	return fmt.Errorf("the move ended without reaching step %q", p["die_at"])
}
