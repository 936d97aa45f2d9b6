package main

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestConfirmed: the one confirmation of forget, migrate down and the failures
// actions. --yes asks nothing; no terminal, or --json, returns the
// confirmation_required error and writes nothing; on a terminal the question is
// asked once, and the answer confirms when typed exactly, with its line end (LF,
// CRLF or none before EOF) and, for an answer with no spaces of its own, with
// spaces around it. An answer that begins or ends with spaces must be typed with
// them.
func TestConfirmed(t *testing.T) {
	t.Parallel()
	refused := confirm(map[string]any{"key": "k"}, "nothing was changed: %s; to do it, run it again with --yes", "forget deletes k")
	ask := func(q question, terminal io.Reader, json bool) (string, error) {
		var stderr strings.Builder
		e := &env{stdout: io.Discard, stderr: &stderr, terminal: terminal, json: json}
		q.refused = refused
		err := e.confirmed(q)
		return stderr.String(), err
	}
	yes := question{want: "yes", shown: "yes", action: "retry these 3 row(s)"}
	const prompt = "Type yes to retry these 3 row(s), anything else to cancel: "
	for _, c := range []struct {
		name, typed string
		q           question
		ok          bool
	}{
		{"exact", "yes\n", yes, true},
		{"CRLF", "yes\r\n", yes, true},
		{"spaces around", "  yes \t\n", yes, true},
		{"EOF without a newline", "yes", yes, true},
		{"wrong", "no\n", yes, false},
		{"wrong case", "YES\n", yes, false},
		{"nothing (EOF)", "", yes, false},
		{"an empty line", "\n", yes, false},
		{"the rest of a second line is not read", "no\nyes\n", yes, false},
	} {
		stderr, err := ask(c.q, strings.NewReader(c.typed), false)
		require.Equal(t, prompt, stderr, c.name)
		if c.ok {
			require.NoError(t, err, c.name)
		} else {
			require.ErrorIs(t, err, errCancelled, c.name)
			require.EqualError(t, err, "cancelled; nothing was changed", c.name)
		}
	}

	// A key with spaces of its own must be typed with them.
	spaced := question{want: " a", shown: "the key ( a)", action: "forget it"}
	for typed, ok := range map[string]bool{" a\n": true, " a\r\n": true, " a": true, "a\n": false, " a \n": false, "  a\n": false} {
		stderr, err := ask(spaced, strings.NewReader(typed), false)
		require.Equal(t, "Type the key ( a) to forget it, anything else to cancel: ", stderr)
		if ok {
			require.NoError(t, err, "%q", typed)
		} else {
			require.ErrorIs(t, err, errCancelled, "%q", typed)
		}
	}

	// --yes: nothing asked, nothing read.
	terminal := strings.NewReader("no\n")
	stderr, err := ask(question{yes: true, want: "yes", shown: "yes", action: "x"}, terminal, false)
	require.NoError(t, err)
	require.Empty(t, stderr)
	require.Equal(t, 3, terminal.Len(), "--yes reads nothing")
	stderr, err = ask(question{yes: true, want: "yes", shown: "yes", action: "x"}, nil, true)
	require.NoError(t, err)
	require.Empty(t, stderr)

	// No terminal, or --json even on one: the confirmation_required error, with
	// its plan, and no question.
	for _, c := range []struct {
		name     string
		terminal io.Reader
		json     bool
	}{{"no terminal", nil, false}, {"--json", strings.NewReader("yes\n"), true}, {"--json without a terminal", nil, true}} {
		stderr, err := ask(yes, c.terminal, c.json)
		require.Empty(t, stderr, c.name)
		var cf *confirmError
		require.True(t, errors.As(err, &cf), "%s: %v", c.name, err)
		require.Equal(t, "nothing was changed: forget deletes k; to do it, run it again with --yes", cf.Error(), c.name)
		require.Equal(t, map[string]any{"key": "k"}, cf.plan, c.name)
		exit, code := classify(err)
		require.Equal(t, exitUsage, exit, c.name)
		require.Equal(t, codeConfirm, code, c.name)
	}
}
