package main

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
)

// errBadDuration says what a duration looks like.
var errBadDuration = errors.New("use a number and a unit, such as 90s, 15m, 12h, 7d or 1d12h")

// parseDuration is time.ParseDuration that also takes days: "7d", "1.5d", "1d12h".
// A day is 24 hours.
func parseDuration(s string) (time.Duration, error) {
	rest, negative := s, false
	if r, ok := strings.CutPrefix(rest, "-"); ok {
		rest, negative = r, true
	} else if r, ok := strings.CutPrefix(rest, "+"); ok {
		rest = r
	}
	signed := func(d time.Duration) time.Duration {
		if negative {
			return -d
		}
		return d
	}
	var total time.Duration
	i := 0
	for i < len(rest) && (rest[i] >= '0' && rest[i] <= '9' || rest[i] == '.') {
		i++
	}
	if i > 0 && i < len(rest) && rest[i] == 'd' {
		days, err := strconv.ParseFloat(rest[:i], 64)
		if err != nil || days*24 > float64(math.MaxInt64/time.Hour) {
			return 0, fmt.Errorf("%q: %w", s, errBadDuration)
		}
		total = time.Duration(days * 24 * float64(time.Hour))
		rest = rest[i+1:]
		if rest == "" {
			return signed(total), nil
		}
	}
	d, err := time.ParseDuration(rest)
	if err != nil || d < 0 || total+d < total {
		return 0, fmt.Errorf("%q: %w", s, errBadDuration)
	}
	return signed(total + d), nil
}

// formatDuration writes d the way parseDuration reads it, with days: "7d", "1d12h0m0s".
func formatDuration(d time.Duration) string {
	const day = 24 * time.Hour
	switch {
	case d == 0:
		return "0s"
	case d < 0:
		return "-" + formatDuration(-d)
	case d%day == 0:
		return fmt.Sprintf("%dd", d/day)
	case d > day:
		return fmt.Sprintf("%dd%s", d/day, d%day)
	}
	return d.String()
}

// durationValue is a pflag.Value for a duration that may be in days.
type durationValue struct{ d *time.Duration }

func (v durationValue) String() string {
	if v.d == nil {
		return ""
	}
	return formatDuration(*v.d)
}

// Type names the value in --help.
func (v durationValue) Type() string { return "duration" }

func (v durationValue) Set(s string) error {
	d, err := parseDuration(s)
	if err != nil {
		return err
	}
	*v.d = d
	return nil
}

// durationVar declares a duration flag that takes days too.
func durationVar(fs *pflag.FlagSet, p *time.Duration, name string, def time.Duration, usage string) {
	*p = def
	fs.Var(durationValue{p}, name, usage)
}

// timeValue is a pflag.Value for a point in time: RFC 3339 (2026-11-21T23:02:11Z), a
// date (2026-11-21, midnight UTC), or a duration meaning that long ago (7d, 90m).
// An age is kept as given until resolve turns it into a time.
type timeValue struct {
	t *time.Time
	// age is the value when it was given as an age (isAge).
	age   time.Duration
	isAge bool
}

func (v *timeValue) String() string {
	if v.t == nil || v.t.IsZero() {
		return ""
	}
	return v.t.UTC().Format(time.RFC3339Nano)
}

// Type names the value in --help.
func (v *timeValue) Type() string { return "time" }

func (v *timeValue) Set(s string) error {
	v.isAge = false
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		*v.t = t
		return nil
	}
	if t, err := time.Parse(time.DateOnly, s); err == nil {
		*v.t = t
		return nil
	}
	d, err := parseDuration(s)
	if err != nil || d < 0 {
		return fmt.Errorf("%q: use a time (2026-11-21T23:02:11Z), a date (2026-11-21) or an age (90m, 7d)", s)
	}
	v.age, v.isAge = d, true
	return nil
}

// resolve sets a value given as an age to the time that long before now, to
// the second (so that it reads back whole as RFC 3339), and reports whether it
// was an age.
func (v *timeValue) resolve(now time.Time) bool {
	if !v.isAge {
		return false
	}
	*v.t = now.Add(-v.age).UTC().Truncate(time.Second)
	return true
}

// resolveAges resolves the time flags of fs given as an age against one now
// (--since 1h --until 30m: the same now) and returns them as absolute flags,
// ["--since", "2026-11-25T09:00:00Z", ...], for a list's next page: the age read
// again by a later run would be another window.
func resolveAges(fs *pflag.FlagSet, now time.Time) []string {
	var pinned []string
	fs.Visit(func(f *pflag.Flag) {
		if v, ok := f.Value.(*timeValue); ok && v.resolve(now) {
			pinned = append(pinned, "--"+f.Name, v.String())
		}
	})
	return pinned
}

// flagGiven reports whether name was on the command line.
func flagGiven(fs *pflag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *pflag.Flag) { given = given || f.Name == name })
	return given
}

// timeVar declares a flag for a point in time (timeValue). An age is resolved
// when the command runs, by resolveAges.
func timeVar(fs *pflag.FlagSet, p *time.Time, name, usage string) {
	fs.Var(&timeValue{t: p}, name, usage)
}

// optString is a string flag that knows whether it was given, so that an empty
// --tenant (the unscoped tenant) differs from no --tenant (every tenant).
type optString struct {
	v   string
	set bool
}

func (o *optString) String() string { return o.v }

// Type names the value in --help.
func (o *optString) Type() string { return "string" }

func (o *optString) Set(s string) error {
	o.v, o.set = s, true
	return nil
}

// ptr is the value when given, else nil.
func (o *optString) ptr() *string {
	if !o.set {
		return nil
	}
	v := o.v
	return &v
}
