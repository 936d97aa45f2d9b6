package inboxdb_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/inboxdb"
	"github.com/idemkit/idem/internal/pgtest"
)

// BenchmarkClaimGrowth measures one claim-and-commit with 0, 1M and 10M rows already
// in the inbox, for time-ordered keys (UUIDv7, which land at the right edge of the
// primary-key B-tree) and random keys (UUIDv4, which land on random pages).
//
//	go test -run '^$' -bench ClaimGrowth -benchtime 5000x ./inbox
func BenchmarkClaimGrowth(b *testing.B) {
	for _, rows := range []int{0, 1_000_000, 10_000_000} {
		b.Run(fmt.Sprintf("rows=%d", rows), func(b *testing.B) { benchClaimAt(b, rows) })
	}
}

func benchClaimAt(b *testing.B, rows int) {
	ctx := context.Background()
	{
		pool, schema := pgtest.Setup(b)
		store, err := inboxdb.NewStore(schema)
		if err != nil {
			b.Fatal(err)
		}
		if rows > 0 {
			// Existing keys are random UUIDs, as a long-lived inbox of mixed
			// producers would have; md5 gives 32 hex digits, formatted like a UUID.
			_, err := pool.Exec(ctx, `INSERT INTO inbox (consumer, key, fingerprint, state, completed_at, expires_at)
				SELECT 'bench', uuid_in(md5(i::text)::cstring)::text, '\x00', 'completed', now(), now() + interval '7 days'
				FROM generate_series(1, $1) i`, rows)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := pool.Exec(ctx, `VACUUM ANALYZE inbox`); err != nil {
				b.Fatal(err)
			}
		}
		for _, kind := range []string{"v7", "v4"} {
			b.Run("keys="+kind, func(b *testing.B) {
				fp := []byte{1}
				for b.Loop() {
					key := uuid.Must(uuid.NewV7()).String()
					if kind == "v4" {
						key = uuid.NewString()
					}
					err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						_, err := store.ClaimTx(ctx, tx, inboxdb.Claim{ID: inboxdb.ID{Consumer: "bench", Key: key}, Fingerprint: fp})
						return err
					})
					if err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
