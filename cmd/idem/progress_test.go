package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// logLines reads what was written to path, as lines; none holds \r, and none is
// longer than a line of a log.
func logLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NotContains(t, string(b), "\r", "no bar frames in a file: %q", b)
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	for _, l := range lines {
		require.LessOrEqual(t, len(l), 120, "a plain line: %q", l)
	}
	return lines
}

// idem bench > log 2>&1: stderr is a file, and bench's progress writes plain
// lines to it (the first state, then its end), not \r frames.
func TestBenchProgressToAFileIsPlainLines(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "log")
	f, err := os.Create(path)
	require.NoError(t, err)
	bar := newBenchProgress(&env{stderr: f}, "idem")
	for i := range 1000 {
		bar.update(i, 1000)
	}
	bar.done()
	require.NoError(t, f.Close())
	lines := logLines(t, path)
	require.Len(t, lines, 2, "%q", lines)
	require.Regexp(t, `^idem\s+0% 0/1000 \d+s$`, lines[0])
	require.Regexp(t, `^idem\s+done in `, lines[1])
}

// Off a terminal, a plain line at most every plainEvery: a minute of updates,
// five a second, is thirteen lines (at 0 s, 5 s, … 60 s) and the last.
func TestProgressPlainLinesNowAndThen(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "log")
	f, err := os.Create(path)
	require.NoError(t, err)
	clock := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	p := newProgress(f, func() time.Time { return clock })
	require.False(t, p.terminal)
	for i := range 301 {
		p.show(float64(i)/300, "step "+strings.Repeat("x", i%7))
		clock = clock.Add(200 * time.Millisecond)
	}
	p.end("finished")
	require.NoError(t, f.Close())
	lines := logLines(t, path)
	require.Len(t, lines, 14, "%q", lines)
	for _, l := range lines[:13] {
		require.True(t, strings.HasPrefix(l, "step "), "%q", l)
	}
	require.Equal(t, "finished", lines[13])
}

// Through a pipe (idem demo | tee log) it is the same: lines, no frames.
func TestProgressToAPipeIsPlainLines(t *testing.T) {
	t.Parallel()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	p := newProgress(w, time.Now)
	require.False(t, p.terminal)
	p.show(0.5, "half")
	p.end("done")
	require.NoError(t, w.Close())
	b := make([]byte, 100)
	n, _ := r.Read(b)
	require.Equal(t, "half\ndone\n", string(b[:n]))
}
