package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/term"
)

// Progress is drawn as a bar on a terminal, and as plain lines anywhere else.
const (
	// frameEvery is how often a bar is redrawn, at most.
	frameEvery = 200 * time.Millisecond
	// plainEvery is how often a plain line is written, at most: a file or a
	// pipe (a CI log, idem bench > log 2>&1) gets a line now and then, as
	// docker build --progress=plain does, never a frame.
	plainEvery = 5 * time.Second
	// barWidth is the bar's width in characters.
	barWidth = 30
)

// progress shows how far a long command (bench, demo) has come, on stderr, or
// nowhere with --json. On a terminal it redraws one line in place (\r); written
// to a file or a pipe it writes whole lines, without \r.
type progress struct {
	w        io.Writer
	terminal bool
	// now is the clock the redraws are paced by.
	now   func() time.Time
	last  time.Time
	shown int // the length of the frame on the terminal's line, 0 for none
}

// progress is a progress display on the command's stderr.
func (e *env) progress() *progress {
	return newProgress(e.notes(), time.Now)
}

// newProgress draws on w: bars when w is a terminal, plain lines otherwise.
func newProgress(w io.Writer, now func() time.Time) *progress {
	f, ok := w.(*os.File)
	return &progress{w: w, terminal: ok && term.IsTerminal(int(f.Fd())), now: now}
}

// show draws the state: a bar filled to frac (0 to 1) and text after it, unless
// the last draw was too recent.
func (p *progress) show(frac float64, text string) {
	now := p.now()
	every := plainEvery
	if p.terminal {
		every = frameEvery
	}
	if !p.last.IsZero() && now.Sub(p.last) < every {
		return
	}
	p.last = now
	if !p.terminal {
		fmt.Fprintf(p.w, "%s\n", text)
		return
	}
	n := int(min(max(frac, 0), 1) * barWidth)
	p.frame(fmt.Sprintf("[%s%s] %s", strings.Repeat("#", n), strings.Repeat(".", barWidth-n), text))
}

// end writes the last line, text (none when ""), and ends the bar's line on a
// terminal.
func (p *progress) end(text string) {
	if text != "" && !p.terminal {
		fmt.Fprintf(p.w, "%s\n", text)
	}
	if !p.terminal {
		return
	}
	if text != "" {
		p.frame(text)
	}
	if p.shown > 0 {
		fmt.Fprintln(p.w)
	}
	p.shown = 0
}

// frame redraws the terminal's line: over the last frame, with spaces where it
// was longer.
func (p *progress) frame(s string) {
	fmt.Fprintf(p.w, "\r%s%s", s, strings.Repeat(" ", max(p.shown-len(s), 0)))
	p.shown = len(s)
}
