package chaos

import "context"

// SetBetweenReads makes a's reports call f after reading the inbox and before
// reading the business rows: a test commits there to race the report.
func SetBetweenReads(a *Auditor, f func()) { a.betweenReads = f }

// The kinds of delivery a Subscriber hands on, for the tests that check them.
type (
	EventKind = eventKind
	Event     = event
)

const (
	EventOriginal       = eventOriginal
	EventDuplicate      = eventDuplicate
	EventRedelivery     = eventRedelivery
	EventNackRedelivery = eventNackRedelivery
)

// KindOf is what kind of delivery the message of ctx is.
func KindOf(ctx context.Context) (EventKind, bool) { return kindOf(ctx) }

// SetObserver makes s tell f of every delivery; call it before Subscribe.
func SetObserver(s *Subscriber, f func(Event)) { s.observer = f }
