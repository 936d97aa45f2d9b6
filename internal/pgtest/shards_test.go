package pgtest

import (
	"context"
	"testing"
	"time"
)

// TestOwnCluster: a test's own cluster answers, is down after Crash (pg_ctl stop
// -m immediate) and answers again after Start, and a row committed before the
// crash is still there.
func TestOwnCluster(t *testing.T) {
	c := StartOwnCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg, err := configAt(c.URL, "public", Options{}, 2)
	if err != nil {
		t.Fatal(err)
	}
	pool := OpenPool(t, cfg)
	if _, err := pool.Exec(ctx, `CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)`); err != nil {
		t.Fatal(err)
	}
	c.Crash()
	if err := pingURL(ctx, c.URL); err == nil {
		t.Fatal("the cluster answers after its crash")
	}
	c.Start()
	pool.Reset() // its connections died with the server
	if n := Count(t, pool, `SELECT sum(n) FROM kept`); n != 7 {
		t.Fatalf("the committed row after the restart: %d, want 7", n)
	}
}
