package chaos

import (
	"errors"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
)

func TestParseCrashSpec(t *testing.T) {
	c, err := parseCrashSpec("before-commit:nth=3, after-commit-before-ack:0.5,mid-send", 1)
	require.NoError(t, err)
	for _, p := range crashPoints {
		require.True(t, c.Armed(p), p)
	}
	var hits []bool
	for range 4 {
		hits = append(hits, c.Hit(BeforeCommit))
	}
	require.Equal(t, []bool{false, false, true, false}, hits, "nth=3 fires at the third hit only")
	require.True(t, c.Hit(MidSend), "no trigger: the first hit")
	require.False(t, c.Hit(MidSend))
	fired := 0
	for range 1000 {
		if c.Hit(AfterCommitBeforeAck) {
			fired++
		}
	}
	require.InDelta(t, 500, fired, 80)

	for _, bad := range []string{"after-commit", "before-commit:nth=0", "before-commit:1.5", "mid-send:x"} {
		_, err := parseCrashSpec(bad, 1)
		require.Error(t, err, bad)
	}
	empty, err := parseCrashSpec("", 1)
	require.NoError(t, err)
	require.False(t, empty.Hit(BeforeCommit))
	var none *crasher
	none.Crash(BeforeCommit) // a nil crasher never fires
}

func TestCrashMiddlewareFiresOnlyAfterSuccess(t *testing.T) {
	c, err := parseCrashSpec("after-commit-before-ack:1", 1)
	require.NoError(t, err)
	var fired []CrashPoint
	c.kill = func(p CrashPoint) { fired = append(fired, p) }
	failing := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, errors.New("nope") })
	_, _ = failing(message.NewMessage("a", nil))
	require.Empty(t, fired, "a failed handler did not commit")
	ok := c.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
	_, _ = ok(message.NewMessage("a", nil))
	require.Equal(t, []CrashPoint{AfterCommitBeforeAck}, fired)
}
